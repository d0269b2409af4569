"""KFP's MLflow integration (KFP 2.17, KEP-12862), against a real ``mlflow server``: KFP's API server opens one
parent run per pipeline run in its experiment, the driver one nested run per task, and each task's container
gets ``MLFLOW_TRACKING_URI``, ``MLFLOW_EXPERIMENT_ID`` and ``MLFLOW_RUN_ID`` (the task's nested run). Here the
test plays KFP's part with the MLflow REST client and runs relaunch's real prepare and finalize steps and the
trainer's run lookup with those variables set, then reads back every run of the experiment."""

from __future__ import annotations

import pytest

from relaunch.components import finalize, prepare
from relaunch.components.core.contract.config import RelaunchConfig
from relaunch.components.core.contract.errors import BadInput
from relaunch.components.core.tracking.client import KFP_TASK_RUN_TAG, PARENT_RUN_TAG, ensure_run

pytestmark = pytest.mark.slow


class FakeKfp:
    """What KFP's API server and driver do to MLflow (the parts relaunch sees), through the public client."""

    def __init__(self, uri: str, experiment: str, monkeypatch):
        from mlflow.tracking import MlflowClient

        self.client, self.uri, self.monkeypatch = MlflowClient(uri), uri, monkeypatch
        self.experiment_id = self.client.create_experiment(experiment)
        self.parent = self.client.create_run(self.experiment_id, run_name="pipeline-run",
                                             tags={"kfp.pipeline_run_id": "kfp-run-1"}).info.run_id

    def enter_task(self, name: str) -> str:
        """The driver's nested run of one task, and the variables it puts into the task's container."""
        task = self.client.create_run(self.experiment_id, run_name=name,
                                      tags={PARENT_RUN_TAG: self.parent}).info.run_id
        for key, value in {"MLFLOW_TRACKING_URI": self.uri, "MLFLOW_EXPERIMENT_ID": self.experiment_id,
                           "MLFLOW_RUN_ID": task}.items():
            self.monkeypatch.setenv(key, value)
        return task

    def leave_task(self, task: str) -> None:
        """The launcher closes the task's nested run when the task's container exits."""
        self.client.set_terminated(task, "FINISHED")

    def runs(self):
        return self.client.search_runs([self.experiment_id], max_results=100)


def _config(tmp_path, experiment: str) -> RelaunchConfig:
    # the configured URI is a dead one: MLFLOW_TRACKING_URI, as KFP injects it, must win
    return RelaunchConfig.model_validate({
        "store": {"uri": str(tmp_path / "store")},
        "tracking": {"uri": "http://127.0.0.1:9", "experiment": experiment},
        "train": {"hidden_size": 8},
    })


def test_under_kfp_the_training_run_nests_under_the_pipeline_run_and_is_never_a_second_top_level_run(
        mlflow_server, tmp_path, monkeypatch):
    kfp = FakeKfp(mlflow_server.uri, "kfp-default", monkeypatch)
    config = _config(tmp_path, "relaunch-kfp")

    task = kfp.enter_task("prepare")
    prepared = prepare.run(config, pipeline_run_id="kfp-run-1")
    kfp.leave_task(task)
    task = kfp.enter_task("prepare")  # KFP retried the step: the same training run, not another one
    assert prepare.run(config, pipeline_run_id="kfp-run-1").run_id == prepared.run_id
    kfp.leave_task(task)
    kfp.enter_task("finalize")
    assert finalize.run(config, pipeline_run_id="kfp-run-1", state="SUCCEEDED").status == "FINISHED"

    runs = {r.info.run_id: r for r in kfp.runs()}
    top_level = [r for r in runs.values() if PARENT_RUN_TAG not in r.data.tags]
    assert [r.info.run_id for r in top_level] == [kfp.parent]
    training = runs[prepared.run_id]
    assert training.data.tags[PARENT_RUN_TAG] == kfp.parent
    assert training.data.tags[KFP_TASK_RUN_TAG] in runs and training.info.status == "FINISHED"
    assert len([r for r in runs.values() if r.data.tags.get("relaunch.pipeline_run_id") == "kfp-run-1"]) == 1
    from mlflow.tracking import MlflowClient
    assert MlflowClient(mlflow_server.uri).get_experiment_by_name("relaunch-kfp") is None


def test_an_injected_run_without_a_parent_becomes_the_parent_of_the_training_run(mlflow_server, tmp_path,
                                                                                 monkeypatch):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(mlflow_server.uri)
    experiment_id = client.create_experiment("kfp-flat")
    injected = client.create_run(experiment_id).info.run_id
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.uri)
    monkeypatch.setenv("MLFLOW_RUN_ID", injected)
    run_id = ensure_run(_config(tmp_path, "relaunch-flat"))
    assert client.get_run(run_id).data.tags[PARENT_RUN_TAG] == injected
    top_level = [r for r in client.search_runs([experiment_id]) if PARENT_RUN_TAG not in r.data.tags]
    assert [r.info.run_id for r in top_level] == [injected]


def test_an_injected_run_the_server_does_not_have_is_bad_input_naming_the_variable(mlflow_server, tmp_path,
                                                                                  monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.uri)
    monkeypatch.setenv("MLFLOW_RUN_ID", "0123456789abcdef0123456789abcdef")
    with pytest.raises(BadInput, match="MLFLOW_RUN_ID"):
        ensure_run(_config(tmp_path, "relaunch-missing"), pipeline_run_id="kfp-run-2")
