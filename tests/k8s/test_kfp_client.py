"""``relaunch submit|schedule --target kfp`` through the real ``kfp.Client`` against an HTTP server that
implements the KFP v2beta1 REST endpoints it calls (tests/k8s/kfp_server.py), checking each request
body: the uploaded and submitted specs parse as ``PipelineSpec``, parameters carry the declared types,
the recurring run is one at a time with no catch-up on a six-field cron, and no credential is in any body."""

from __future__ import annotations

import json

import pytest
import yaml
from google.protobuf import json_format
from kfp.pipeline_spec import pipeline_spec_pb2
from kfp_server_api.exceptions import ApiException

from relaunch.components.core.contract.config import RelaunchConfig
from relaunch.pipelines.cli import main
from relaunch.pipelines.commands.compile import render
from tests.k8s.kfp_server import KfpServer
from tests.services import S3_ACCESS_KEY, S3_SECRET_KEY

TOKEN = "kfp-bearer-token-for-tests"
MLFLOW_PASSWORD = "relaunch-test-mlflow-password-42"
pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def kfp(monkeypatch, tmp_path):
    """The fake API server, kfp.Client pointed at it, and every credential a user has in the environment."""
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.config/kfp context from the machine
    monkeypatch.setenv("KF_PIPELINES_TOKEN", TOKEN)
    for key, value in {"AWS_ACCESS_KEY_ID": S3_ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": S3_SECRET_KEY,
                       "MLFLOW_TRACKING_USERNAME": "relaunch-test-user", "MLFLOW_TRACKING_PASSWORD": MLFLOW_PASSWORD}.items():
        monkeypatch.setenv(key, value)
    with KfpServer() as server:
        monkeypatch.setenv("KF_PIPELINES_ENDPOINT", server.url)
        yield server


def parses_as_pipeline_spec(spec: dict) -> None:
    json_format.ParseDict(spec, pipeline_spec_pb2.PipelineSpec())


def assert_no_credential_in_any_body(server: KfpServer) -> None:
    for req in server.requests:
        payload = req.body + b"".join(req.files.values())
        for secret in (S3_ACCESS_KEY, S3_SECRET_KEY, MLFLOW_PASSWORD, TOKEN):
            assert secret.encode() not in payload, f"{secret!r} in the body of {req.method} {req.path}"
        assert req.headers.get("authorization", req.headers.get("Authorization")) == f"Bearer {TOKEN}"


def test_submit_creates_one_run_of_the_compiled_pipeline_with_typed_parameters(kfp):
    assert main(["submit", "--target", "kfp", "--run-name", "nightly", "--param", "epochs=8",
                 "--param", "learning_rate=0.02", "--set", "launch.backend=trainjob"]) == 0
    (run,) = kfp.calls("POST", "/runs")
    body = run.json
    parses_as_pipeline_spec(body["pipeline_spec"]["pipeline_spec"])
    json_format.ParseDict(body["pipeline_spec"]["platform_spec"], pipeline_spec_pb2.PlatformSpec())
    assert body["display_name"] == "nightly"
    assert body["service_account"] == "relaunch-pipeline"
    assert body["runtime_config"]["parameters"] == {"epochs": 8, "learning_rate": 0.02}
    assert body["experiment_id"] in kfp.experiments
    defaults = body["pipeline_spec"]["pipeline_spec"]["root"]["inputDefinitions"]["parameters"]
    assert json.loads(defaults["config_json"]["defaultValue"])["launch"]["backend"] == "trainjob"
    assert_no_credential_in_any_body(kfp)


def test_schedule_uploads_a_version_and_creates_one_recurring_run_at_a_time_without_catch_up(kfp):
    assert main(["schedule", "--target", "kfp", "--cron", "15 2 * * 1", "--version", "v7", "--param", "nodes=4"]) == 0
    (upload,) = kfp.calls("POST", "/pipelines/upload")
    (version,) = kfp.calls("POST", "/pipelines/upload_version")
    for req in (upload, version):
        parses_as_pipeline_spec(next(yaml.safe_load_all(req.files["uploadfile"])))
    assert version.query["name"] == ["v7"]
    (recurring,) = kfp.calls("POST", "/recurringruns")
    body = recurring.json
    assert int(body["max_concurrency"]) == 1
    assert body["no_catchup"] is True
    cron = body["trigger"]["cron_schedule"]["cron"]
    assert cron.split() == ["0", "15", "2", "*", "*", "1"], "KFP's six-field cron, seconds first"
    assert body["mode"] == "ENABLE"
    assert body["service_account"] == "relaunch-pipeline"
    assert body["runtime_config"]["parameters"] == {"nodes": 4}
    ref = body["pipeline_version_reference"]
    assert kfp.versions[ref["pipeline_version_id"]]["pipeline_id"] == ref["pipeline_id"]
    assert_no_credential_in_any_body(kfp)


def test_a_second_schedule_adds_a_version_to_the_same_pipeline_and_experiment(kfp):
    assert main(["schedule", "--target", "kfp", "--cron", "0 3 * * *", "--version", "v1"]) == 0
    assert main(["schedule", "--target", "kfp", "--cron", "0 4 * * *", "--version", "v2"]) == 0
    assert len(kfp.calls("POST", "/pipelines/upload")) == 1
    assert len(kfp.calls("POST", "/pipelines/upload_version")) == 2
    assert len(kfp.experiments) == 1


@pytest.mark.parametrize("argv", [
    ["submit", "--target", "kfp", "--param", "epoch=8"],            # no such parameter
    ["submit", "--target", "kfp", "--param", "epochs=eight"],       # not an integer
    ["schedule", "--target", "kfp", "--cron", "0 3 * * *", "--param", "nodes=two"],
])
def test_bad_parameters_are_refused_in_one_line_before_anything_is_sent(argv, kfp, capsys):
    assert main(argv) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    assert not [r for r in kfp.requests if r.method == "POST"]


def test_the_fake_server_refuses_a_string_for_an_integer_input_as_the_real_one_does(kfp, tmp_path):
    """The body checks can fail: what relaunch sent before it typed the parameters is a 400."""
    import kfp as kfp_sdk

    package = tmp_path / "pipeline.yaml"
    package.write_text(render("kfp", RelaunchConfig()))
    client = kfp_sdk.Client(host=kfp.url, existing_token=TOKEN)
    with pytest.raises(ApiException, match="expected NUMBER_INTEGER"):
        client.create_run_from_pipeline_package(str(package), arguments={"epochs": "8"}, run_name="untyped")
    assert not kfp.runs
