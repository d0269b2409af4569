"""MLflow 3 lineage of a whole ``relaunch run`` against the real ``mlflow server`` on PostgreSQL, with a
worker killed mid-training and the user's own task module (a copy of the digits task as ``mytask.py``
outside the project): the run's logged model, dataset input and system metrics; a registered model
that loads in a fresh process without ``mytask`` on the path; and what a person sees in the MLflow
UI in a headless Chromium (``make ui-check`` also keeps the screenshots in docs/)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.cli import relaunch_run

ROOT = Path(__file__).resolve().parents[2]
MODEL = "lineage-digits"
SCREENSHOTS = os.environ.get("RELAUNCH_UI_SCREENSHOTS")  # a folder: keep the browser's screenshots there

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def finished(tmp_path_factory, mlflow_server):
    """One ``relaunch run`` of ``mytask:make_task`` with a worker SIGKILLed at step 25 of 40."""
    cwd = tmp_path_factory.mktemp("lineage-e2e")
    user_code = tmp_path_factory.mktemp("user-code")
    shutil.copy(ROOT / "components/tasks/digits.py", user_code / "mytask.py")
    # the user's folder first, then the project's own path (a worktree's code, not an installed copy)
    path = os.pathsep.join(p for p in (str(user_code), os.environ.get("PYTHONPATH", "")) if p)
    env = {"PYTHONPATH": path, "MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL": "1"}
    # steps of 0.1 s: each attempt lasts a few seconds, long enough for every node's system metrics
    # the memory tier off: torchrun restarts the group, so the run records a second attempt
    done = relaunch_run(cwd, "--set", "train.max_steps=40", "--inject-failure", "kill-worker@step=25",
                        "--set", "train.memory_tier=false", "--set", "train.step_sleep_seconds=0.1",
                        "--set", "train.task=mytask:make_task", "--set", f"tracking.uri={mlflow_server.uri}",
                        "--set", "tracking.experiment=lineage-e2e", "--set", f"registry.model_name={MODEL}",
                        "--set", "evaluate.gate_min=0.1", env=env, without=("MLFLOW_TRACKING_URI",), timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    client = MlflowClient(mlflow_server.uri)
    experiment = client.get_experiment_by_name("lineage-e2e")
    (run,) = client.search_runs([experiment.experiment_id])
    return cwd, out, client, run, mlflow_server


def _logged_model(client, run):
    uri = run.data.tags["relaunch.evaluated_checkpoint"]
    found = client.search_logged_models([run.info.experiment_id], filter_string=f"source_run_id = '{run.info.run_id}'")
    return next(m for m in found if m.tags.get("relaunch.checkpoint_uri") == uri)


def test_the_run_has_a_logged_model_of_the_evaluated_checkpoint_with_its_metrics_linked(finished):
    _, _, client, run, _ = finished
    model = client.get_logged_model(_logged_model(client, run).model_id)
    assert str(model.status) == "READY" and model.name == "step-000000000040"
    assert [(o.model_id, o.step) for o in run.outputs.model_outputs] == [(model.model_id, 40)]
    linked = {m.key: m.value for m in model.metrics}
    assert linked["eval_test_accuracy"] == pytest.approx(run.data.metrics["eval_test_accuracy"])
    (version,) = client.search_model_versions(f"name = '{MODEL}'")
    assert version.source == f"models:/{model.model_id}"


def test_the_run_has_the_prepared_dataset_as_input_with_its_content_address_as_digest(finished):
    cwd, _, _, run, _ = finished
    (folder,) = (cwd / ".relaunch/store").glob("trainings/*/datasets/sha256-*")  # relaunch run: one training, one dataset
    stored = folder.name
    (entry,) = run.inputs.dataset_inputs
    assert (entry.dataset.name, entry.dataset.digest) == ("digits", stored)
    assert json.loads(entry.dataset.source)["uri"].endswith(f"/datasets/{stored}")


def test_the_run_has_system_metrics_of_every_node(finished):
    _, _, _, run, _ = finished
    for node in ("node-0", "node-1"):
        assert f"system/{node}/cpu_utilization_percentage" in run.data.metrics, sorted(run.data.metrics)


def test_the_run_is_named_described_and_sourced(finished):
    cwd, out, _, run, _ = finished
    (training,) = (cwd / ".relaunch/store/trainings").iterdir()
    assert run.info.run_name == f"relaunch-{training.name}"  # the run names its training's folder
    tags = run.data.tags
    assert tags["mlflow.source.type"] == "JOB" and tags["mlflow.source.git.commit"]
    assert "Outcome: FINISHED" in tags["mlflow.note.content"] and "1 restart(s)" in tags["mlflow.note.content"]
    assert not [k for k in run.data.params if k.startswith("launch.kubernetes.")]
    assert f"/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}?workflowType=machine_learning" in out


def test_the_tags_are_few_and_readable_and_the_histories_are_artifacts(finished, tmp_path):
    _, out, client, run, _ = finished
    tags = run.data.tags
    assert not [k for k in tags if k.startswith(("checkpoint.step-", "relaunch.attempt."))], sorted(tags)
    assert (tags["relaunch.attempts"], tags["relaunch.restarts"], tags["relaunch.last_exit_code"]) == ("2", "1", "0")
    attempts = json.loads(Path(client.download_artifacts(run.info.run_id, "relaunch/attempts.json", str(tmp_path))).read_text())
    assert [a["exit_code"] for a in attempts] == [137, 0]  # the killed worker's attempt, not 138
    history = json.loads(Path(client.download_artifacts(run.info.run_id, "relaunch/checkpoints.json", str(tmp_path))).read_text())
    assert history[-1]["step"] == 40 and history[-1]["uri"] == tags["checkpoint.latest"]
    assert "-> exit 137, retrying" in out and "a peer worker was killed" in out
    assert not [k for k in run.data.metrics if k.startswith("health/")]  # flat zeros: not charted before the loss


def test_the_registered_version_is_described(finished):
    _, _, client, run, _ = finished
    (version,) = client.search_model_versions(f"name = '{MODEL}'")
    text = client.get_model_version(MODEL, version.version).description
    for needle in (run.info.run_name.removeprefix("relaunch-"), run.info.run_id, "at step 40",
                   run.inputs.dataset_inputs[0].dataset.digest, "accuracy=", run.data.tags["checkpoint.latest"]):
        assert needle in text, (needle, text)


def test_the_registered_model_loads_in_a_fresh_process_without_the_task_on_the_path(finished, tmp_path):
    _, _, _, _, server = finished
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["MLFLOW_TRACKING_URI"] = server.uri
    code = ("import importlib.util, json, numpy as np, mlflow\n"
            "assert importlib.util.find_spec('mytask') is None, 'mytask is importable here'\n"
            f"model = mlflow.pyfunc.load_model('models:/{MODEL}@champion')\n"
            "print(json.dumps(model.predict(np.zeros((3, 64), dtype=np.float32)).tolist()))\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(json.loads(done.stdout.strip().splitlines()[-1])) == 3


# ---------------------------------------------------------------- what a person sees in the browser


@pytest.fixture(scope="module")
def browser():
    from tests.browser import Browser, chromium_or_skip

    opened = Browser(chromium_or_skip())
    opened.call("Emulation.setDeviceMetricsOverride", width=1440, height=1000, deviceScaleFactor=1, mobile=False)
    yield opened
    opened.close()


def _shot(browser, name: str, tmp_path: Path) -> None:
    browser.click('button[aria-label="Close"]')  # the MLflow Assistant panel: not ours to show
    browser.screenshot(Path(SCREENSHOTS or tmp_path) / f"mlflow-{name}.png")


def test_the_run_page_shows_the_run_name_the_logged_model_and_the_dataset(finished, browser, tmp_path):
    _, _, client, run, server = finished
    page = f"{server.uri}/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}?workflowType=machine_learning"
    digest = run.inputs.dataset_inputs[0].dataset.digest
    text = browser.open(page, [run.info.run_name, "Logged models (1)", f"digits ({digest})", "Model training"])
    assert run.info.run_name in text
    assert "step-000000000040" in text.split("Logged models (1)", 1)[-1]  # the logged models table
    assert f"digits ({digest})" in text
    _shot(browser, "run", tmp_path)


def test_the_run_page_draws_the_loss_chart(finished, browser, tmp_path):
    _, _, _, run, server = finished
    page = (f"{server.uri}/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}/model-metrics"
            "?workflowType=machine_learning")
    browser.open(page, [run.info.run_name])
    search = 'input[placeholder*="Search metric"]'
    assert browser.wait_for_selector(search), "the model-metrics tab has no metric search box"
    browser.type_into(search, "train/loss")
    text = browser.wait_for(["(train/loss)"])
    assert f"{run.info.run_name} (train/loss)" in text or "(train/loss)" in text
    assert browser.count(".js-plotly-plot") == 1
    _shot(browser, "loss", tmp_path)


def test_the_registered_model_pages_show_the_champion_its_run_and_its_logged_model(finished, browser, tmp_path):
    _, _, client, run, server = finished
    view = "?workflowType=machine_learning"
    text = browser.open(f"{server.uri}/#/models/{MODEL}{view}", [MODEL, "Version 1", "champion"])
    assert "Version 1" in text and "champion" in text
    _shot(browser, "registered-model", tmp_path)
    text = browser.open(f"{server.uri}/#/models/{MODEL}/versions/1{view}",
                        ["Source Run", run.info.run_name, "step-000000000040"])
    assert run.info.run_name in text.split("Source Run", 1)[-1]
    assert "step-000000000040" in text.split("Source Model", 1)[-1]
    _shot(browser, "model-version", tmp_path)
