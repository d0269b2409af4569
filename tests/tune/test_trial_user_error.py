"""A trial whose parameters its training refuses (a global batch larger than the training split: bad input,
exit 2) fails, is not retried, and does not fail the study: the other trial completes, is the best, and
its model is registered."""

from __future__ import annotations

import json

import pytest

from tests.tune.studies import STUDY_TIMEOUT, study_record, trial_record, tune

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2 * STUDY_TIMEOUT)]

BATCH = ["--set", "tune.space.train.global_batch_size={type: categorical, choices: [64, 4096]}",
         "--set", "tune.sampler.seed=13", "--set", "tune.trials=2"]
"""Seed 13 gives trial 0 a batch of 64 and trial 1 one of 4096 (the digits training split has 1257 samples)."""


def test_a_trial_with_a_user_error_fails_alone_and_the_study_registers_the_best_of_the_others(tmp_path):
    done = tune(tmp_path, "--study", "user-error", *BATCH)

    assert done.returncode == 0, done.stderr
    failed, complete = trial_record(tmp_path, "user-error", 1), trial_record(tmp_path, "user-error", 0)
    assert failed["params"]["train.global_batch_size"] == 4096 and complete["params"]["train.global_batch_size"] == 64
    assert (failed["state"], failed["exit_code"], failed["retries"]) == ("failed", 2, 0)
    assert "train.global_batch_size=4096 exceeds the" in failed["reason"]
    log = (tmp_path / ".relaunch/store/studies/user-error/trials/1/launch.log").read_text()
    assert log.count("relaunch tune: trial 1 launched") == 1  # launched once: not retried
    assert "trial 1    failed: exit 2 (bad input" in done.stdout
    record = study_record(tmp_path, "user-error")
    assert (record["state"], record["best_trial"], complete["state"]) == ("finished", 0, "complete")
    assert record["registered"].startswith("relaunch-digits v")

    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path}/.relaunch/mlflow.db")
    run = client.get_run(failed["run_id"])
    assert (run.info.status, run.data.tags["relaunch.trial_state"]) == ("FAILED", "failed")
    parent = json.loads((tmp_path / ".relaunch/store/studies/user-error/runs/mlflow-run.json").read_text())["run_id"]
    assert run.data.tags["mlflow.parentRunId"] == parent
