"""The summary an attempt writes names the checkpoint committed last, one an async save committed
while the trainer closed included (attempt 1 said ``last_committed_step: 19`` while attempt 2 resumed
from step 20)."""

from __future__ import annotations

import contextlib

import torch

from relaunch.components.core.checkpoint import CheckpointManager
from relaunch.components.core.contract.config import RelaunchConfig
from relaunch.components.core.runtime.distributed import read_env
from relaunch.components.core.trainer.saving import TrainerCheckpoints
from relaunch.components.core.store import open_store
from relaunch.components.core.store.ledger import AttemptLog, claim_attempt
from relaunch.components.core.trainer.state import TrainingState
from relaunch.components.tasks.base import load_task


def test_a_save_that_commits_while_the_trainer_closes_after_a_failure_is_the_last_committed(tmp_path, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    config = RelaunchConfig.model_validate({"store": {"uri": str(tmp_path)}, "train": {"hidden_size": 8}})
    manager = CheckpointManager(config.store.uri, async_save=True)
    torch.manual_seed(0)
    state = TrainingState(load_task(config.train.task, config).build_model())
    log = AttemptLog(open_store(config.store.uri), claim_attempt(open_store(config.store.uri), 0.0, 1))
    checkpoints = TrainerCheckpoints(config, read_env(), manager, state, tracker=None, log=log, attempt=1,
                                     evaluate_split=dict, peers=contextlib.nullcontext, steps_per_epoch=19,
                                     total_steps=76)
    manager.save(20, state)  # in flight when the attempt fails
    checkpoints.close(after_failure=True)
    assert checkpoints.last_committed.step == 20 and log.record.last_committed_step == 20
