"""How trials and studies stop, in one sequential study (4 trials, 1 at once, the median pruner after 2
complete trials, no torchrun restart): while it runs, a second ``relaunch tune`` of it is refused in one
line (exit 2); trial 1's worker SIGKILLed ends its launch step 137, and the study retries the trial,
which resumes from its own checkpoint; trial 2, worse than the median at its first validation, is pruned:
sent SIGTERM, it commits its checkpoint, exits 143, is not retried, and the console says so; Ctrl-C
(SIGINT) during trial 3 stops it with its checkpoint and ends ``relaunch tune`` with one line, exit 130 or
143, leaving no process of the study."""

from __future__ import annotations

import signal

import pytest

from tests.cli import relaunch
from tests.tune.studies import (CHECKPOINT_EVERY, OUTSIDE_TRACKING, STUDY, STUDY_TIMEOUT, attempts, committed_step,
                                processes_of, start_tune, summary, trial_record, wait_for, worker_of)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2 * STUDY_TIMEOUT)]

SEQUENTIAL = ["--set", "tune.parallel=1", "--set", "tune.pruner.name=median", "--set", "tune.pruner.startup_trials=2",
              "--set", "tune.pruner.warmup_steps=0", "--set", "launch.max_restarts=0"]
STOP_DEADLINE = 60.0
"""How long relaunch tune may take to end after Ctrl-C (a trial commits its checkpoint): a bound for a hang."""


def test_a_retried_trial_resumes_a_pruned_one_stops_cleanly_a_second_tune_is_refused_and_ctrl_c_stops_all(tmp_path):
    proc = start_tune(tmp_path, "--study", "stops", *SEQUENTIAL)
    wait_for("trial 0 to run", lambda: trial_record(tmp_path, "stops", 0).get("state") == "running", proc)

    second = relaunch(tmp_path, "tune", *STUDY, "--study", "stops", "--resume", *SEQUENTIAL, without=OUTSIDE_TRACKING,
                      timeout=120)
    assert second.returncode == 2, second.stderr
    assert second.stderr.strip().splitlines() == [second.stderr.strip()]
    assert f"the study stops is being run by pid {proc.pid} on host" in second.stderr

    wait_for("trial 1's first checkpoint", lambda: committed_step(tmp_path, "stops", 1) >= CHECKPOINT_EVERY, proc)
    worker = wait_for("trial 1's worker", lambda: worker_of(tmp_path, "stops", 1), proc)
    killed_after = committed_step(tmp_path, "stops", 1)
    worker.send_signal(signal.SIGKILL)

    pruned = wait_for("trial 2 to be pruned", lambda: trial_record(tmp_path, "stops", 2).get("state") == "pruned"
                      and trial_record(tmp_path, "stops", 2), proc)
    wait_for("trial 3's first checkpoint", lambda: committed_step(tmp_path, "stops", 3) >= CHECKPOINT_EVERY, proc)
    proc.send_signal(signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=STOP_DEADLINE)
    except Exception:
        proc.kill()
        raise

    retried = trial_record(tmp_path, "stops", 1)
    assert (retried["state"], retried["retries"], len(retried["optuna_numbers"])) == ("complete", 1, 1)
    assert "trial 1    exit 137 (killed (SIGKILL, OOM)): retry 1/2, resuming from its own checkpoint" in out
    assert attempts(tmp_path, "stops", 1)[1]["resumed_from_step"] >= killed_after >= CHECKPOINT_EVERY

    assert (pruned["step"], pruned["exit_code"], pruned["retries"]) == (CHECKPOINT_EVERY, 143, 0)
    stopped = summary(tmp_path, "stops", 2)
    assert stopped["exit_code"] == 143 and stopped["last_committed_step"] == stopped["last_step"] < 40
    assert f"trial 2    pruned at step {CHECKPOINT_EVERY} (val_loss " in out and "> median" in out
    assert "trial 2    pruned at step 10; it stopped cleanly (exit 143), not retried" in out

    assert proc.returncode in (130, 143), err
    assert err.strip().splitlines() == [err.strip()] and err.startswith("relaunch: stopped by Ctrl-C (SIGINT); ")
    assert "`relaunch tune --resume --study stops` continues it" in err
    interrupted = summary(tmp_path, "stops", 3)
    committed_stop = interrupted["exit_code"] == 143 and interrupted["last_committed_step"] == interrupted["last_step"]
    assert (proc.returncode == 143) == committed_stop
    assert trial_record(tmp_path, "stops", 3)["state"] == "running"  # a resume continues it
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path}/.relaunch/mlflow.db")
    runs = {n: client.get_run(trial_record(tmp_path, "stops", n)["run_id"]) for n in range(4)}
    assert [(r.data.tags["relaunch.trial_state"], r.info.status) for r in runs.values()] == [
        ("complete", "FINISHED"), ("complete", "FINISHED"), ("pruned", "KILLED"), ("interrupted", "KILLED")]
    assert processes_of(tmp_path, "stops") == []
