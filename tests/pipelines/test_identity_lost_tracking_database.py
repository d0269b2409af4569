"""A training whose MLflow run is gone (``mlflow.db`` deleted, checkpoints intact): ``--resume`` says so in one
line with the command that continues it, and that command, run as printed, finishes the pipeline in a new
MLflow run that records the old one."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.cli import RUN_TIMEOUT, newest_training, relaunch, relaunch_run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3 * RUN_TIMEOUT + 60)]


def _run_as_printed(cwd: Path, command: str) -> subprocess.CompletedProcess:
    argv = shlex.split(command)
    assert argv[0] == "relaunch", command
    return relaunch(cwd, *argv[1:])


def test_a_training_whose_mlflow_database_was_lost_continues_with_the_command_the_error_prints(tmp_path):
    from relaunch.components.core.store import open_store
    from relaunch.components.core.store.records import read_summary, stored_run_id

    # a training that trained to its end and whose register failed (a champion metric nobody reports)
    first = relaunch_run(tmp_path, "--set", "train.max_steps=20", "--set", "evaluate.gate_min=0",
                         "--set", "registry.champion_metric=acuracy")
    assert first.returncode != 0, first.stdout[-2000:]
    training = open_store(newest_training(str(tmp_path / ".relaunch/store")))
    old_run = stored_run_id(training)
    assert old_run and read_summary(training)["last_step"] == 20
    checkpoints = sorted(training.list("checkpoints/", recursive=False))
    (tmp_path / ".relaunch/mlflow.db").unlink()  # the tracking database is lost; the store is not

    refused = relaunch_run(tmp_path, "--resume", "--set", "registry.champion_metric=accuracy")
    assert refused.returncode == 2, refused.stdout[-2000:] + refused.stderr[-2000:]
    line = refused.stderr.strip()
    assert len(line.splitlines()) == 1 and old_run in line, line
    command = re.search(r"`(relaunch run [^`]*)`", line)
    assert command, line
    assert stored_run_id(training) == old_run and sorted(training.list("checkpoints/", recursive=False)) == checkpoints

    done = _run_as_printed(tmp_path, command[1])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    client = MlflowClient(f"sqlite:///{tmp_path}/.relaunch/mlflow.db")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert len(runs) == 1, [r.info.run_id for r in runs]
    new = runs[0]
    assert new.info.run_id != old_run and new.info.status == "FINISHED"
    assert new.data.tags["relaunch.previous_run_id"] == old_run
    assert new.data.tags["relaunch.resumed_from_checkpoint"].endswith(f"checkpoints/step-{20:012d}")
    assert stored_run_id(training) == new.info.run_id
    versions = client.search_model_versions()
    assert [v.run_id for v in versions] == [new.info.run_id]  # registered from the training's checkpoint
    again = relaunch_run(tmp_path, "--resume")
    assert again.returncode == 0 and "nothing to do" in again.stdout, again.stdout[-2000:] + again.stderr[-2000:]
