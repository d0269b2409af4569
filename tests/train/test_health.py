"""Divergence and a tracking server that goes away, with real torchrun and real MLflow servers."""

from __future__ import annotations

import uuid

import pytest

from relaunch.components.core.store import records
from relaunch.components.core.checkpoint import CheckpointManager
from relaunch.components.core.contract.classify import torchrun_exit
from relaunch.components.core.contract.exitcodes import ExitCode
from relaunch.components.core.store import open_store
from tests.services import MlflowServer
from tests.train.conftest import metric_steps, mlflow_runs, run_torchrun, start_torchrun, train_config

pytestmark = pytest.mark.slow


def test_a_nan_loss_exits_3_keeps_the_last_good_checkpoint_untouched_and_fails_the_run(tmp_path, tracking):
    config = train_config(tmp_path, tracking, task="tests.train.tasks:nan_task", checkpoint_at_epoch_end=False)
    run = run_torchrun(config, tmp_path, max_restarts=1, env={"NAN_AT_STEP": "25"})

    store = open_store(config["store"]["uri"])
    assert run.proc.returncode == ExitCode.BUG, run.output()[-3000:]  # torchrun's blanket 1 (test_supervise: 3)
    assert torchrun_exit(run.proc.returncode, records.read_exit_record(store), run.started_at) == 3, run.output()[-3000:]
    assert "non-finite loss at step 25" in run.output()
    assert "not restarting after a permanent failure" in run.output(), "torchrun's restart ends at once"
    manager = CheckpointManager(store)
    assert [c.step for c in manager.list()] == [10, 20]
    assert manager.verify(20).step == 20 and manager.latest().step == 20
    [mlrun] = mlflow_runs(tracking, config["tracking"]["experiment"])
    assert mlrun.info.status == "FAILED"
    assert "diverged" in mlrun.data.tags["relaunch.end_reason"]


def test_training_continues_while_mlflow_is_down_and_its_metrics_arrive_after_it_returns(tmp_path, postgres):
    server = MlflowServer(backend_uri=postgres.create_database(f"outage_{uuid.uuid4().hex[:8]}"),
                          artifacts_dir=tmp_path / "artifacts").start()
    try:
        steps = 240
        config = train_config(tmp_path, server.uri, max_steps=steps, step_sleep_seconds=0.04,
                              checkpoint_every_steps=60)
        run = start_torchrun(config, tmp_path)
        run.wait_for("PROGRESS", lambda r: r["step"] >= 10)
        server.stop()
        down_at = run.records("PROGRESS")[-1]["step"]
        run.wait_for("PROGRESS", lambda r: r["step"] >= down_at + 40, timeout=60)  # still training
        server.start()
        assert run.wait() == 0, run.output()[-3000:]
        assert "lost contact with the tracking server" in run.output()
        # what the trainer had not sent when it stopped waiting for the server is in the store: the
        # pipeline's finalize (or prepare of a --resume) sends it, as here
        from relaunch.components.core.contract.config import RelaunchConfig
        from relaunch.components.core.tracking.mlflow_tracker import deliver_pending_metrics

        store = open_store(config["store"]["uri"])
        assert deliver_pending_metrics(RelaunchConfig.model_validate(config), store, records.stored_run_id(store),
                                       who="test")

        [mlrun] = mlflow_runs(server.uri, config["tracking"]["experiment"])
        assert mlrun.info.status == "FINISHED"
        assert sorted(metric_steps(server.uri, mlrun.info.run_id)) == list(range(1, steps + 1))
        assert mlrun.data.tags["relaunch.tracking.lost_contact"] == "true"
    finally:
        server.stop()


def test_a_hung_rank_is_detected_by_the_watchdog_which_dumps_stacks_and_exits_retryable(tmp_path, tracking):
    config = train_config(tmp_path, tracking, task="tests.train.tasks:hanging_task", hang_timeout_seconds=3)
    run = run_torchrun(config, tmp_path, env={"HANG_AT_STEP": "15"})

    store = open_store(config["store"]["uri"])
    assert torchrun_exit(run.proc.returncode, records.read_exit_record(store), run.started_at) == 138, run.output()[-3000:]
    assert "no training step progress" in run.output() and "Thread 0x" in run.output()  # the stack dump
    assert CheckpointManager(store).latest().step == 10


@pytest.mark.ci_lane  # the same injection through the whole pipeline: test_local_run's storage outage on S3
def test_an_injected_storage_outage_is_absorbed_by_retries_and_training_finishes(tmp_path, tracking):
    config = train_config(tmp_path, tracking)
    config["launch"] = {"inject_failure": "storage-outage@step=15"}
    run = run_torchrun(config, tmp_path)

    assert run.proc.returncode == 0, run.output()[-3000:]
    assert "the store fails for 3 s" in run.output()
    assert run.records("SUMMARY")[-1]["last_committed_step"] == 40
    manager = CheckpointManager(open_store(config["store"]["uri"]))
    assert [manager.verify(c.step).step for c in manager.list()] == [30, 38, 40]  # keep_last=3, epoch end at 38
