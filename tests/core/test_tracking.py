"""The MLflow run life cycle (components/core/tracking/client.py), the asynchronous logger
(components/core/tracking/runlogger.py) and the trainer's tracking object (components/core/trainer/tracking.py),
against a real ``mlflow server`` on Postgres."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relaunch.components.core.contract.config import RelaunchConfig
from relaunch.components.core.contract.errors import BadInput, TransientFailure

pytestmark = pytest.mark.slow


def _config(uri: str, experiment: str, **tracking) -> RelaunchConfig:
    return RelaunchConfig.model_validate({"tracking": {"uri": uri, "experiment": experiment, **tracking}})


def test_a_restarted_logger_never_logs_a_step_the_server_already_has(mlflow_server):
    from mlflow.tracking import MlflowClient

    from relaunch.components.core.tracking.runlogger import RunLogger
    from relaunch.components.core.tracking.client import ensure_run, mark_run_finished

    config = _config(mlflow_server.uri, "logger-units")
    run_id = ensure_run(config, pipeline_run_id="units-1")
    assert ensure_run(config, pipeline_run_id="units-1") == run_id
    first = RunLogger(mlflow_server.uri, run_id)
    for step in range(1, 11):
        first.log_metrics({"train/loss": 1.0 / step}, step)
    assert first.close(30)
    second = RunLogger(mlflow_server.uri, run_id)  # a resumed attempt recomputes steps 6..10
    for step in range(6, 16):
        second.log_metrics({"train/loss": 1.0 / step}, step)
    assert second.close(30)
    steps = [m.step for m in MlflowClient(mlflow_server.uri).get_metric_history(run_id, "train/loss")]
    assert sorted(steps) == list(range(1, 16)) and second.stats.points_skipped_as_logged == 5
    mark_run_finished(config, run_id, "KILLED", reason="test")
    assert MlflowClient(mlflow_server.uri).get_run(run_id).info.status == "KILLED"


def test_a_call_submitted_again_while_queued_runs_once_after_everything_queued_before_it(mlflow_server):
    from relaunch.components.core.tracking.client import ensure_run
    from relaunch.components.core.tracking.runlogger import RunLogger

    run_id = ensure_run(_config(mlflow_server.uri, "logger-coalesce"))
    seen: list[tuple[str, dict]] = []

    class Reconcile:  # equal to each other, as a tracker's bound method is
        def __eq__(self, other):
            return isinstance(other, Reconcile)

        def __call__(self, client, run_id):
            seen.append(("reconcile", dict(client.get_run(run_id).data.tags)))

    logger = RunLogger(mlflow_server.uri, run_id, defer_start=True)  # nothing is sent before start
    for n in range(5):
        logger.set_tags({"checkpoint.latest_step": n})
        logger.submit(Reconcile())
    logger.submit(lambda client, run_id: seen.append(("other", {})))
    assert logger.close(30)
    assert [kind for kind, _ in seen] == ["reconcile", "other"] and logger.stats.coalesced_calls == 4
    assert seen[0][1]["checkpoint.latest_step"] == "4"  # it ran after the last tags were sent
    assert logger.stats.sender_cpu_by_kind.get("call", 0) > 0


def test_a_full_batch_of_points_with_tags_is_sent_whole_within_the_servers_limit(mlflow_server):
    from mlflow.tracking import MlflowClient

    from relaunch.components.core.tracking.client import ensure_run
    from relaunch.components.core.tracking.runlogger import RunLogger

    run_id = ensure_run(_config(mlflow_server.uri, "logger-limit"))
    logger = RunLogger(mlflow_server.uri, run_id, defer_start=True)
    for step in range(1, 201):  # 1000 points: one full request, and the tags on top of it
        logger.log_metrics({f"m/{i}": float(step) for i in range(5)}, step)
    logger.set_tags({"relaunch.test": "yes"})
    assert logger.close(60) and logger.stats.dropped_ops == 0
    client = MlflowClient(mlflow_server.uri)
    assert len(client.get_metric_history(run_id, "m/4")) == 200
    assert client.get_run(run_id).data.tags["relaunch.test"] == "yes"


def test_after_its_first_send_a_logger_no_longer_searches_for_databricks_modules_on_every_request(mlflow_server):
    import importlib.util
    import sys

    from relaunch.components.core.tracking.client import ensure_run
    from relaunch.components.core.tracking.runlogger import RunLogger

    absent = [n for n in ("dbruntime", "IPython", "pyspark")  # None: an earlier logger recorded it as absent
              if (sys.modules[n] is None if n in sys.modules else importlib.util.find_spec(n) is None)]
    if not absent:
        pytest.skip("every module MLflow looks for per request is installed here")
    looked_for: list[str] = []

    class Observer:  # sees every import that reaches the finders, finds nothing itself
        def find_spec(self, name, path=None, target=None):
            looked_for.append(name)
            return None

    run_id = ensure_run(_config(mlflow_server.uri, "logger-lookups"))
    logger = RunLogger(mlflow_server.uri, run_id)
    logger.log_metrics({"m": 1.0}, 1)
    assert logger.flush(30)
    sys.meta_path.insert(0, observer := Observer())
    try:
        for step in range(2, 5):
            logger.log_metrics({"m": float(step)}, step)
            assert logger.flush(30)
    finally:
        sys.meta_path.remove(observer)
        logger.close(30)
    assert not set(looked_for) & set(absent), looked_for


def test_params_are_logged_once_and_a_changed_value_becomes_a_latest_tag(mlflow_server):
    from relaunch.components.core.tracking.client import client, ensure_run, find_pipeline_run, log_new_params

    config = _config(mlflow_server.uri, "params-units")
    run_id = ensure_run(config, pipeline_run_id="params-1")
    assert find_pipeline_run(config, "params-1") == run_id and find_pipeline_run(config, "nope") is None
    mlflow_client = client(mlflow_server.uri)
    log_new_params(mlflow_client, run_id, {"a": 1, "b": "x"})
    log_new_params(mlflow_client, run_id, {"a": 1, "b": "y", "c": None})
    data = mlflow_client.get_run(run_id).data
    assert data.params == {"a": "1", "b": "x"} and data.tags["param.b.latest"] == "y"


def test_a_missing_run_is_bad_input_by_its_error_code_and_an_unreachable_server_is_transient(mlflow_server,
                                                                                           monkeypatch):
    from relaunch.components.core.tracking.client import ensure_run

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    with pytest.raises(BadInput, match="does not exist"):
        ensure_run(_config(mlflow_server.uri, "missing", run_id="0123456789abcdef0123456789abcdef"))
    # a proxy's "404 not found" page or a dead port is no answer of MLflow's: retryable, never bad input
    with pytest.raises(TransientFailure):
        ensure_run(_config("http://127.0.0.1:1404", "missing", run_id="notfound"))


def test_an_unreachable_tracking_server_whose_url_contains_403_is_not_a_credentials_error(monkeypatch):
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import PERMISSION_DENIED, UNAUTHENTICATED
    from mlflow.tracking import MlflowClient

    from relaunch.components.core.tracking.client import is_auth_error

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    with pytest.raises(Exception) as unreachable:  # nothing listens on port 1403
        MlflowClient("http://127.0.0.1:1403").get_run("run403")
    assert "1403" in str(unreachable.value) and not is_auth_error(unreachable.value)
    for code in (UNAUTHENTICATED, PERMISSION_DENIED):
        assert is_auth_error(MlflowException("API request failed", error_code=code))
    # never by text: a message that says 401 without MLflow's code (a real 401 carries UNAUTHENTICATED)
    assert not is_auth_error(MlflowException("API request to endpoint /x failed with error code 401 != 200"))


def test_not_found_is_mlflows_error_code_not_a_message_saying_not_found():
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE, RESOURCE_DOES_NOT_EXIST

    from relaunch.components.core.tracking.client import is_not_found

    assert is_not_found(MlflowException("Run 'x' not found", error_code=RESOURCE_DOES_NOT_EXIST))
    assert not is_not_found(RuntimeError("upstream proxy: 404 page not found"))
    missing_alias = MlflowException("Registered model alias champion not found.", error_code=INVALID_PARAMETER_VALUE)
    assert is_not_found(missing_alias, alias_lookup=True) and not is_not_found(missing_alias)


def test_the_checkpoint_history_is_one_artifact_that_marks_what_retention_deleted_and_health_waits_for_non_zero(mlflow_server, tmp_path):
    from mlflow.tracking import MlflowClient

    from relaunch.components.core.checkpoint import CheckpointInfo, step_key
    from relaunch.components.core.store import open_store
    from relaunch.components.core.tracking.client import ensure_run
    from relaunch.components.core.tracking.mlflow_tracker import ATTEMPTS_ARTIFACT, CHECKPOINTS_ARTIFACT, DELETED_BY_RETENTION
    from relaunch.components.core.trainer.tracking import TrainingTracker

    from relaunch.components.core.store import ledger

    config = _config(mlflow_server.uri, "checkpoint-tags")
    run_id = ensure_run(config, pipeline_run_id="tags-1")
    store = open_store(str(tmp_path))
    killed = ledger.AttemptLog(store, ledger.claim_attempt(store, 0.0, 1))  # SIGKILLed before its logger sent
    killed.committed(5, 1.0, 0.0)

    def commit(tracker, step):
        logs[tracker.attempt].committed(step, float(step), 0.0)  # as the trainer records a commit first
        store.write_bytes(f"{step_key(step)}/MANIFEST.json", b"{}")
        tracker.checkpoint_committed(CheckpointInfo(step=step, uri=store.uri_for(step_key(step)), key=step_key(step),
                                                    epoch=0, world_size=1, created_at="", metrics={},
                                                    manifest_sha256=""))

    logs = {1: killed}
    logs[2] = ledger.AttemptLog(store, ledger.claim_attempt(store, 2.0, 1))
    tracker = TrainingTracker(config, store, enabled=True, run_id=run_id, attempt=2)
    tracker.start(resumed_from=-1, resumed_uri=None, params={}, world_size=1)
    tracker.step_done(1)  # this attempt's first step: the logger starts sending
    for step, spikes in ((1, 0.0), (2, 1.0)):  # a health counter is charted from its first non-zero value
        tracker.log_step(step, {"train/loss": 1.0}, {"health/loss_spikes": spikes}, total_steps=40, epoch=0, spike=False)
    commit(tracker, 10)
    commit(tracker, 20)
    tracker.close(30)
    store.delete_many(store.list(step_key(10)))  # what retention does, between two attempts
    logs[3] = ledger.AttemptLog(store, ledger.claim_attempt(store, 3.0, 1))
    again = TrainingTracker(config, store, enabled=True, run_id=run_id, attempt=3)
    again.start(resumed_from=20, resumed_uri=store.uri_for(step_key(20)), params={}, world_size=1)
    again.step_done(22)
    commit(again, 30)
    again.close(30)
    client = MlflowClient(mlflow_server.uri)
    tags = client.get_run(run_id).data.tags
    assert not [k for k in tags if k.startswith(("checkpoint.step-", "relaunch.attempt."))]  # no wall of tags
    history = json.loads(Path(client.download_artifacts(run_id, CHECKPOINTS_ARTIFACT, str(tmp_path))).read_text())
    assert [(c["step"], c["attempt"], c["state"]) for c in history] == [
        (5, 1, DELETED_BY_RETENTION), (10, 2, DELETED_BY_RETENTION), (20, 2, "kept"), (30, 3, "kept")]
    assert history[-1]["uri"] == tags["checkpoint.latest"] == store.uri_for(step_key(30))
    attempts = json.loads((Path(client.download_artifacts(run_id, ATTEMPTS_ARTIFACT, str(tmp_path)))).read_text())
    assert (attempts[0]["exit_code"], attempts[0]["end_recorded"]) == (137, False)  # its record has no end: killed
    assert (tags["relaunch.attempts"], tags["relaunch.last_exit_code"]) == ("3", "137")
    assert tags["relaunch.resumed_from"] == store.uri_for(step_key(20))
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "health/loss_spikes")] == [(2, 1.0)]


def test_off_rank_0_the_tracking_object_does_nothing(tmp_path, capsys):
    from relaunch.components.core.trainer.tracking import TrainingTracker

    tracker = TrainingTracker(RelaunchConfig(), None, enabled=False, run_id=None, attempt=3)
    tracker.start(resumed_from=-1, resumed_uri=None, params={"a": 1}, world_size=2)
    tracker.step_done(1)
    tracker.log_step(1, {"train/loss": 1.0}, {"train/epoch": 0.0}, total_steps=2, epoch=0, spike=True)
    tracker.log_evaluation(1, {"val_loss": 1.0}, before_checkpoint=True)
    tracker.finish(1, {}, {})
    assert tracker.trackers == [] and tracker.overhead(1, 1.0) == {}
    assert capsys.readouterr() == ("", "")  # no resumed/progress event, no spike line
