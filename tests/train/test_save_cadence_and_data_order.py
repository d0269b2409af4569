"""When the trainer saves, and the order it reads the data in: pure functions of the configuration,
checked without starting a training."""

from __future__ import annotations

import numpy as np
import pytest

from relaunch.components.core.contract.config import RelaunchConfig
from relaunch.components.core.trainer.saving import SaveCadence
from relaunch.components.core.data.loader import StepBatches
from relaunch.components.core.data.order import GlobalOrder


def _train(**fields):
    return RelaunchConfig.model_validate({"train": fields}).train


@pytest.mark.parametrize("fields,steps_per_epoch,total,saved_after", [
    ({"checkpoint_every_steps": 10, "checkpoint_at_epoch_end": False}, 100, 35, [10, 20, 30]),
    ({"checkpoint_every_steps": 10, "checkpoint_at_epoch_end": True}, 19, 40, [10, 19, 20, 30, 38]),
    ({"checkpoint_every_steps": None, "checkpoint_at_epoch_end": True}, 19, 38, [19]),  # 38: the end saves it
    ({"checkpoint_every_steps": None, "checkpoint_at_epoch_end": False}, 19, 40, []),
])
def test_saves_come_every_n_steps_and_at_epoch_ends_but_never_at_the_last_step(fields, steps_per_epoch, total,
                                                                               saved_after):
    cadence = SaveCadence(_train(**fields), steps_per_epoch, total, keeps_time=True)
    assert [s for s in range(1, total + 1) if cadence.wanted(s, time_due=False)] == saved_after


def test_only_the_rank_that_keeps_the_time_says_a_timed_save_is_due():
    train = _train(checkpoint_every_seconds=1e-9, checkpoint_every_steps=None)
    assert SaveCadence(train, 10, 100, keeps_time=True).time_due()
    assert not SaveCadence(train, 10, 100, keeps_time=False).time_due()
    assert SaveCadence(train, 10, 100, keeps_time=False).wanted(5, time_due=True)  # what the ranks agreed on


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_the_ranks_slices_of_a_step_are_the_global_batch_whatever_the_world_size(world_size):
    global_batch = 8
    order = GlobalOrder([16, 16, 16, 16], seed=3, window_shards=2)
    steps = [list(StepBatches(order, 8, 20, global_batch, rank, world_size, start_step=0)) for rank in range(world_size)]
    for step in (0, 5, 9, 17):
        epoch, within = divmod(step, 8)
        rows = [i for rank in range(world_size) for i in steps[rank][step]]
        assert rows == order.indices(epoch, np.arange(within * global_batch, (within + 1) * global_batch)).tolist()
    epoch0 = order.indices(0, np.arange(64)).tolist()
    assert sorted(epoch0) == list(range(64)) and epoch0 != order.indices(1, np.arange(64)).tolist()
