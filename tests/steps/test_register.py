"""The register step against a real MLflow registry (sqlite) and real checkpoints: the champion gate,
the pin that retention respects, an idempotent retry, and a model that loads without unpickling."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from relaunch.components import register
from relaunch.components.core.checkpoint import CheckpointManager
from relaunch.components.core.contract.config import RelaunchConfig
from relaunch.components.core.trainer.state import TrainingState
from relaunch.components.core.tracking.client import ensure_run
from relaunch.components.tasks.base import load_task


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("register")
    config = RelaunchConfig.model_validate({
        "store": {"uri": str(root / "store")},
        "tracking": {"uri": f"sqlite:///{root / 'mlflow.db'}", "artifact_location": str(root / "art")},
        "train": {"hidden_size": 8},
    })
    config.tracking.run_id = ensure_run(config, pipeline_run_id="register-test")
    task = load_task(config.train.task, config)
    mgr = CheckpointManager(config.store.uri, keep_last=10, async_save=False)
    for step in (10, 11, 12):
        torch.manual_seed(step)
        mgr.save(step, TrainingState(task.build_model()), metrics={"val_loss": 1.0})
    uris = {c.step: c.uri for c in mgr.list()}
    return config, mgr, uris


@pytest.fixture(scope="module")
def history(setup):
    """Three registrations: v1 (0.90), a worse v2 (0.80), a better v3 (0.95)."""
    config, mgr, uris = setup
    out = {}
    for label, step, accuracy in (("first", 10, 0.90), ("worse", 11, 0.80), ("better", 12, 0.95)):
        out[label] = register.run(config, uris[step],
                                  json.dumps({"accuracy": accuracy, "loss": 0.1}))
    return out


def test_the_first_version_becomes_challenger_and_champion(history):
    first = history["first"]
    assert first.version == "1" and json.loads(first.aliases) == ["challenger", "champion"]


def test_a_worse_model_does_not_take_champion_and_says_why(setup, history):
    config, _, _ = setup
    worse = history["worse"]
    assert worse.champion_version == "1" and json.loads(worse.aliases) == ["challenger"]
    from mlflow.tracking import MlflowClient

    v2 = MlflowClient(config.tracking.uri).get_model_version(config.registry.model_name, "2")
    assert v2.tags["relaunch.champion_decision"].startswith("not promoted: accuracy=0.8 does not beat")


def test_a_better_model_takes_champion(history):
    better = history["better"]
    assert better.version == "3" and better.champion_version == "3"
    assert json.loads(better.aliases) == ["challenger", "champion"]


def test_a_margin_keeps_the_champion_when_the_gain_is_smaller(setup, history):
    config, mgr, _ = setup
    strict = config.model_copy(deep=True)
    strict.registry.champion_margin = 0.5
    torch.manual_seed(13)
    mgr.save(13, TrainingState(load_task(config.train.task, config).build_model()), metrics={"val_loss": 1.0})
    out = register.run(strict, mgr.latest().uri, json.dumps({"accuracy": 0.99}))
    assert out.champion_version == "3" and "by the margin 0.5" in out.champion_decision


def test_registered_checkpoints_are_pinned_and_survive_retention(setup, history):
    config, mgr, _ = setup
    strict = CheckpointManager(config.store.uri, keep_last=1, async_save=False)
    torch.manual_seed(99)
    strict.save(20, TrainingState(load_task(config.train.task, config).build_model()), metrics={"val_loss": 1.0})
    assert {10, 11, 12} <= {c.step for c in strict.list()}  # keep_last=1 keeps them only because they are pinned
    assert {10, 11, 12} <= set(strict.pins())
    unpinned = CheckpointManager(config.store.uri, keep_last=1, async_save=False)
    torch.manual_seed(98)
    unpinned.save(21, TrainingState(load_task(config.train.task, config).build_model()), metrics={"val_loss": 1.0})
    assert 20 not in {c.step for c in unpinned.list()}  # retention does run: the unpinned step 20 went


def test_a_retried_register_finds_its_version_instead_of_adding_one(setup, history):
    config, mgr, _ = setup
    again = register.run(config, _uri(mgr, 12), json.dumps({"accuracy": 0.95}))
    assert again.version == "3"


def test_the_version_records_run_checkpoint_dataset_and_commit(setup, history):
    config, mgr, _ = setup
    from mlflow.tracking import MlflowClient

    v = MlflowClient(config.tracking.uri).get_model_version(config.registry.model_name, "3")
    assert v.run_id == config.tracking.run_id
    assert v.tags["relaunch.checkpoint_uri"] == _uri(mgr, 12)
    assert {"relaunch.dataset_version", "relaunch.git_commit", "relaunch.metric.accuracy"} <= set(v.tags)


def test_the_version_is_described_with_its_training_step_dataset_metrics_and_checkpoint(setup, history):
    config, mgr, _ = setup
    from mlflow.tracking import MlflowClient

    text = MlflowClient(config.tracking.uri).get_model_version(config.registry.model_name, "3").description
    for needle in (config.tracking.run_id, "at step 12", "dataset `digits`", "accuracy=0.95", _uri(mgr, 12)):
        assert needle in text, (needle, text)


def test_registering_leaves_mlflows_process_wide_tracking_uri_as_it_was(setup, history):
    import os

    import mlflow

    assert not mlflow.is_tracking_uri_set() and "MLFLOW_TRACKING_URI" not in os.environ
    mlflow.set_tracking_uri("http://127.0.0.1:9")
    try:
        with register._process_tracking_uri(setup[0].tracking.uri):
            assert mlflow.get_tracking_uri() == setup[0].tracking.uri
        assert mlflow.get_tracking_uri() == os.environ["MLFLOW_TRACKING_URI"] == "http://127.0.0.1:9"
    finally:
        mlflow.set_tracking_uri(None)


def test_the_registered_model_loads_and_predicts_without_unpickling(setup, history, tmp_path):
    import mlflow
    import numpy as np

    config, _, _ = setup
    mlflow.set_tracking_uri(config.tracking.uri)
    try:
        local = Path(mlflow.artifacts.download_artifacts(f"models:/{config.registry.model_name}@champion",
                                                         dst_path=str(tmp_path)))
        model = mlflow.pyfunc.load_model(f"models:/{config.registry.model_name}@champion")
    finally:
        mlflow.set_tracking_uri(None)  # it exports MLFLOW_TRACKING_URI; later tests must not inherit it
    files = [p.name for p in local.rglob("*") if p.is_file()]
    assert "model.safetensors" in files
    assert not [f for f in files if f.endswith((".pkl", ".pickle", ".pt", ".pth", ".cloudpickle"))]
    assert "loader_module: relaunch.components.core.packaging.model" in (local / "MLmodel").read_text()
    x = load_task(config.train.task, config).build_splits()["test"]["x"][:5]
    assert model.predict(np.asarray(x)).shape == (5,)


def _uri(mgr, step: int) -> str:
    return next(c.uri for c in mgr.list() if c.step == step)


# ---------------------------------------------------------------- the champion read against a real server


class _BlipProxy:
    """An HTTP proxy in front of the real ``mlflow server``: once a request matching ``arm_on``
    (method, path part) has been forwarded, the next ``times`` GETs whose path contains one of
    ``fail_paths`` are answered 503 (a transient blip); everything else is forwarded."""

    def __init__(self, upstream: str, arm_on: tuple[str, str], fail_paths: tuple[str, ...], times: int = 1):
        import http.client
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        from urllib.parse import urlparse

        target = urlparse(upstream)
        self.refused: list[str] = []
        self.armed = False
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def _forward(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if proxy.armed and self.command == "GET" and any(p in self.path for p in fail_paths):
                    proxy.refused.append(self.path)
                    proxy.armed = len(proxy.refused) < times
                    self.send_response(503)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                conn = http.client.HTTPConnection(target.hostname, target.port, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
                conn.request(self.command, self.path, body=body or None, headers=headers)
                answer = conn.getresponse()
                data = answer.read()
                self.send_response(answer.status)
                for key, value in answer.getheaders():
                    if key.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                conn.close()
                if self.command == arm_on[0] and arm_on[1] in self.path and not proxy.refused:
                    proxy.armed = True

            do_GET = do_POST = do_PATCH = do_PUT = do_DELETE = _forward

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.uri = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_a_champion_that_cannot_be_read_is_a_retryable_failure_not_no_champion(tmp_path, mlflow_server, monkeypatch):
    from mlflow.tracking import MlflowClient

    from relaunch.components.core.contract.errors import TransientFailure
    from relaunch.components.core.contract.exitcodes import ExitCode

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # the 503 reaches our code at once
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    config = RelaunchConfig.model_validate({
        "store": {"uri": str(tmp_path / "store")}, "tracking": {"uri": mlflow_server.uri},
        "train": {"hidden_size": 8}, "registry": {"model_name": "flaky-champion"},
    })
    config.tracking.run_id = ensure_run(config, pipeline_run_id="flaky-champion")
    task = load_task(config.train.task, config)
    mgr = CheckpointManager(config.store.uri, async_save=False)
    for step in (10, 11):
        torch.manual_seed(step)
        mgr.save(step, TrainingState(task.build_model()), metrics={"val_loss": 1.0})
    first = register.run(config, _uri(mgr, 10), json.dumps({"accuracy": 0.9}))
    assert first.champion_version == "1"

    from relaunch.components import evaluate

    assert evaluate.run(config).checkpoint_uri == _uri(mgr, 11)  # its LoggedModel, made directly
    # after challenger is set, the champion's read answers 503 on every try of the call (before the
    # fix that read was the alias lookup, now it is the registered model's)
    from relaunch.components.core.tracking.client import TRIES

    proxy = _BlipProxy(mlflow_server.uri, arm_on=("POST", "registered-models/alias"),
                       fail_paths=("registered-models/alias", "registered-models/get"), times=TRIES)
    try:
        flaky = config.model_copy(update={"tracking": config.tracking.model_copy(update={"uri": proxy.uri})})
        with pytest.raises(TransientFailure) as raised:
            register.run(flaky, _uri(mgr, 11), json.dumps({"accuracy": 0.5}))
    finally:
        proxy.close()
    assert raised.value.exit_code == ExitCode.RETRY_ME and proxy.refused
    champion = MlflowClient(mlflow_server.uri).get_model_version_by_alias("flaky-champion", "champion")
    assert champion.version == "1"  # the worse model did not take the alias


def test_a_model_without_a_champion_alias_gets_its_first_champion_on_a_real_server(tmp_path, mlflow_server):
    config = RelaunchConfig.model_validate({
        "store": {"uri": str(tmp_path / "store")}, "tracking": {"uri": mlflow_server.uri},
        "train": {"hidden_size": 8}, "registry": {"model_name": "no-champion-yet"},
    })
    config.tracking.run_id = ensure_run(config, pipeline_run_id="no-champion-yet")
    from mlflow.tracking import MlflowClient

    MlflowClient(mlflow_server.uri).create_registered_model("no-champion-yet")  # a model, no alias
    torch.manual_seed(0)
    mgr = CheckpointManager(config.store.uri, async_save=False)
    mgr.save(5, TrainingState(load_task(config.train.task, config).build_model()), metrics={"val_loss": 1.0})
    out = register.run(config, _uri(mgr, 5), json.dumps({"accuracy": 0.7}))
    assert out.champion_version == out.version and out.champion_decision.startswith("promoted: first version")
