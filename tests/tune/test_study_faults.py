"""A study survives its failures: one 4-trial study, 2 at once, in which a trial's worker is SIGKILLed
mid-training (torchrun restarts it; it resumes from its checkpoint) and later ``relaunch tune`` itself is
SIGKILLed after a trial completed and while others run (``--resume`` continues it: no completed trial runs
again, the running ones resume from their checkpoints in their folders and MLflow runs). It ends with
the same best trial and value as the same study run uninterrupted beside it, one MLflow child run per
trial under the study's, and the best trial's model registered through the gate.

One faulted study serves several tests (each names what it checks): its faults are independent, and
running it once keeps ``make test`` short."""

from __future__ import annotations

import json
import signal
import time

import pytest

from tests.tune.studies import (CHECKPOINT_EVERY, STUDY_TIMEOUT, attempts, committed_step, events, processes_of,
                                start_tune, study_record, summary, trial_record, tune, values, wait_for, worker_of)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3 * STUDY_TIMEOUT)]

ORPHAN_DEADLINE = 10.0
"""How long the study's processes may take to end after ``relaunch tune`` is killed (its guardian kills
them): a bound for a hang, not a timed assertion."""


@pytest.fixture(scope="module")
def cwd(tmp_path_factory):
    return tmp_path_factory.mktemp("tune")


@pytest.fixture(scope="module")
def reference(cwd):
    """The study uninterrupted."""
    done = tune(cwd, "--study", "reference")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    return values(cwd, "reference")


@pytest.fixture(scope="module")
def faulted(cwd, reference):
    """The same study with a worker killed, then ``relaunch tune`` killed and resumed; what was seen."""
    seen: dict = {}
    proc = start_tune(cwd, "--study", "faults")
    # trial 1's worker, once its first checkpoint committed and before its last
    wait_for("trial 1's first checkpoint", lambda: committed_step(cwd, "faults", 1) >= CHECKPOINT_EVERY, proc)
    worker = wait_for("trial 1's worker", lambda: worker_of(cwd, "faults", 1), proc)
    seen["worker_killed_after_step"] = committed_step(cwd, "faults", 1)
    seen["worker_command"] = worker.cmdline()
    worker.send_signal(signal.SIGKILL)

    # relaunch tune itself, once trial 0 completed and while a later trial runs past its first checkpoint
    def running_trial():
        if trial_record(cwd, "faults", 0).get("state") != "complete":
            return None
        return next((n for n in (2, 3) if trial_record(cwd, "faults", n).get("state") == "running"
                     and committed_step(cwd, "faults", n) >= CHECKPOINT_EVERY
                     and summary_step(n) < 40), None)

    def summary_step(n):
        try:
            return summary(cwd, "faults", n).get("last_step", -1)
        except FileNotFoundError:
            return -1

    wait_for("a later trial running past its first checkpoint", running_trial, proc)
    seen["at_kill"] = {n: dict(trial_record(cwd, "faults", n)) for n in range(4)}
    seen["committed_at_kill"] = {n: committed_step(cwd, "faults", n) for n in range(4)}
    seen["attempts_at_kill"] = {n: len(attempts(cwd, "faults", n)) for n in range(4)}
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    deadline = time.monotonic() + ORPHAN_DEADLINE
    while processes_of(cwd, "faults") and time.monotonic() < deadline:
        time.sleep(0.1)
    seen["orphans"] = [" ".join(p.cmdline()[:4]) for p in processes_of(cwd, "faults")]
    for p in processes_of(cwd, "faults"):
        p.kill()
    seen["resume"] = tune(cwd, "--study", "faults", "--resume")
    assert seen["resume"].returncode == 0, seen["resume"].stdout[-3000:] + seen["resume"].stderr[-2000:]
    seen["after"] = {n: trial_record(cwd, "faults", n) for n in range(4)}
    return seen


def test_a_killed_trial_worker_resumes_from_its_checkpoint_losing_at_most_one_interval(cwd, faulted):
    """It resumes from the checkpoint committed when it was killed (not from step 0), and the steps it had
    done past it (its last progress event: rank 0 passes one on at most four times a second, so the real
    step may be a few further; the kill came right after that checkpoint) are at most one interval."""
    runs = attempts(cwd, "faults", 1)
    assert len(runs) >= 2, runs
    killed, resumed = runs[0], runs[1]
    assert killed["exit_code"] in (None, 137), killed  # a SIGKILLed rank 0 records nothing
    assert resumed["resumed_from_step"] >= faulted["worker_killed_after_step"] >= CHECKPOINT_EVERY
    progress = [e["step"] for e in events(cwd, "faults", 1) if e["kind"] == "progress" and e["attempt"] == 1]
    reached = max(progress + [faulted["worker_killed_after_step"]])
    assert reached - resumed["resumed_from_step"] <= CHECKPOINT_EVERY
    assert faulted["after"][1]["state"] == "complete"
    assert faulted["after"][1]["retries"] == 0  # torchrun's restart, inside the trial: not a retry of it


def test_a_killed_tune_resumes_the_running_trials_from_their_checkpoints_and_reruns_no_completed_one(cwd, faulted):
    at_kill, after = faulted["at_kill"], faulted["after"]
    completed = [n for n, r in at_kill.items() if r.get("state") == "complete"]
    running = [n for n, r in at_kill.items() if r.get("state") == "running" and faulted["committed_at_kill"][n] >= 0]
    assert 0 in completed and running, at_kill
    for n in completed:
        assert after[n] == at_kill[n]  # not one field changed: not told, not run
        assert len(attempts(cwd, "faults", n)) == faulted["attempts_at_kill"][n]
    for n in running:
        assert after[n]["run_id"] == at_kill[n]["run_id"]  # the same MLflow run across the resume
        assert len(after[n]["optuna_numbers"]) == 2 and after[n]["optuna_numbers"][0] == at_kill[n]["optuna_numbers"][0]
        first_after_resume = attempts(cwd, "faults", n)[faulted["attempts_at_kill"][n]]
        assert first_after_resume["resumed_from_step"] >= faulted["committed_at_kill"][n]
    assert "resumed in its folder" in faulted["resume"].stdout


def test_every_trials_worker_is_a_fork_of_the_studys_zygote_through_its_client(cwd, faulted):
    from relaunch.components.core.runtime.zygote import CLIENT_SOURCE

    assert str(CLIENT_SOURCE) in faulted["worker_command"], faulted["worker_command"]
    logs = {str(path): path.read_text(errors="replace") for path in cwd.rglob("launch.log")}
    assert len(logs) >= 8 and not [path for path, text in logs.items() if "starting the worker cold" in text], logs


def test_sigkill_of_relaunch_tune_leaves_no_process_of_its_trials(faulted):
    assert faulted["orphans"] == []


def test_the_faulted_study_ends_with_the_same_trials_and_best_as_the_uninterrupted_one(cwd, reference, faulted):
    assert values(cwd, "faults") == reference
    assert all(state == "complete" for state, _ in reference.values())
    best = study_record(cwd, "faults")
    assert best["state"] == "finished"
    assert (best["best_trial"], best["best_value"]) == (study_record(cwd, "reference")["best_trial"],
                                                        study_record(cwd, "reference")["best_value"])


def test_mlflow_shows_the_study_run_with_one_child_per_trial_and_the_best_model_registered_through_the_gate(cwd, faulted):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{cwd}/.relaunch/mlflow.db")
    parent_id = (cwd / ".relaunch" / "store" / "studies" / "faults" / "runs" / "mlflow-run.json").read_text()
    parent = client.get_run(json.loads(parent_id)["run_id"])
    experiment = parent.info.experiment_id
    children = client.search_runs([experiment], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert sorted(int(c.data.tags["relaunch.trial"]) for c in children) == [0, 1, 2, 3]  # one run per trial
    for child in children:
        n = int(child.data.tags["relaunch.trial"])
        assert child.info.run_id == faulted["after"][n]["run_id"]
        assert (child.data.tags["relaunch.trial_state"], child.info.status) == ("complete", "FINISHED")
        assert child.data.params["train.lr"] == str(faulted["after"][n]["params"]["train.lr"])
    restarted = next(c for c in children if c.data.tags["relaunch.trial"] == "1")
    assert int(restarted.data.tags.get("relaunch.attempts", "1")) >= 2
    record = study_record(cwd, "faults")
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["relaunch.best_trial"] == str(record["best_trial"])
    assert parent.data.metrics["best_value"] == pytest.approx(record["best_value"], rel=0, abs=0)
    assert parent.data.params["tune.sampler.seed"] == "0" and "tune.space.train.lr.type" in parent.data.params
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id, "study")}
    assert {"study/objective.png", "study/importance.png", "study/trials.json"} <= artifacts

    best_run = faulted["after"][record["best_trial"]]["run_id"]
    versions = client.search_model_versions("name = 'relaunch-digits'")
    mine = [v for v in versions if v.run_id == best_run]
    assert len(mine) == 1 and f"studies/faults/trials/{record['best_trial']}/" in mine[0].tags["relaunch.checkpoint_uri"]
    assert float(mine[0].tags["relaunch.metric.accuracy"]) >= 0.5  # the gate it passed
    assert record["registered"] == f"relaunch-digits v{mine[0].version}"
