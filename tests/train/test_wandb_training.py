"""A real torchrun training with ``tracking.wandb`` (offline) and ``tracking.tensorboard_dir`` killed twice:
one W&B run across the three attempts, every step logged once and in order, read back from the run's own
files, whether or not rank 0 closed its W&B run before torchrun stopped it (on a busy machine it often does
not); TensorBoard's loader shows every step once too."""

from __future__ import annotations

import os

import pytest

from relaunch.components.core.tracking.wandb_tracker import wandb_run_id
from tests.core.wandb_records import read_offline_runs
from tests.train.conftest import mlflow_runs, run_torchrun, train_config
from tests.needs import needed

needed("wandb", "the W&B tracker's tests need the test extra: pip install -e '.[test]'")
EventAccumulator = needed("tensorboard.backend.event_processing.event_accumulator",
                          "the test extra: pip install -e '.[test]'").EventAccumulator
pytestmark = pytest.mark.slow


def test_a_training_killed_twice_keeps_one_wandb_run_with_every_step_once_in_order(tmp_path, tracking, monkeypatch):
    for name in [k for k in os.environ if k.startswith("WANDB_")]:  # an in-process wandb of an earlier test
        monkeypatch.delenv(name)  # (its service address) must not reach these trainings
    wandb_dir = tmp_path / "wandb-dir"
    wandb_dir.mkdir()
    env = {"WANDB_DIR": str(wandb_dir), "WANDB_SILENT": "true"}
    config = train_config(tmp_path, tracking)
    config["tracking"]["wandb"] = {"project": "relaunch-test", "mode": "offline"}
    config["tracking"]["tensorboard_dir"] = str(tmp_path / "tb")

    config["launch"] = {"inject_failure": "kill-worker@step=15"}
    first = run_torchrun(config, tmp_path, name="first", env=env)
    assert first.proc.returncode != 0, first.output()[-3000:]
    config["launch"] = {"inject_failure": "kill-worker@step=28"}
    second = run_torchrun(config, tmp_path, name="second", env=env, max_restarts=1)
    assert second.proc.returncode == 0, second.output()[-3000:]

    [mlflow_run] = mlflow_runs(tracking, config["tracking"]["experiment"])
    run = read_offline_runs(str(wandb_dir))
    assert run.files == 3 and set(run.run_ids) == {wandb_run_id(mlflow_run.info.run_id, "")}
    assert run.steps == list(range(1, 41)), f"a step missing, twice or out of order: {run.steps}"
    assert "relaunch/wandb_missing_steps" not in run.summary
    assert run.config["world_size"] == 2 and run.summary["relaunch/attempt"] == 3
    board = EventAccumulator(str(tmp_path / "tb"))
    board.Reload()
    assert [event.step for event in board.Scalars("train/loss")] == list(range(1, 41))
    assert run.summary["checkpoint.latest"].endswith("checkpoints/step-000000000040") and run.artifacts
