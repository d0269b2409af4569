"""A damaged newest checkpoint never stops a training: a real 2-process torchrun training resumes from
the previous committed checkpoint, writes the damaged step again and ends where an undamaged run ends,
bitwise (docs/checkpoint-format.md, "Quarantine")."""

from __future__ import annotations

import pytest
import torch

from relaunch.components.core.checkpoint import CheckpointManager, step_key
from relaunch.components.core.store import open_store
from tests.train.conftest import final_params, run_torchrun, train_config

pytestmark = pytest.mark.slow


def test_a_training_whose_newest_checkpoint_is_damaged_trains_past_that_step_again_to_the_end(tmp_path, tracking):
    config = train_config(tmp_path, tracking, checkpoint_at_epoch_end=False)  # saves 10, 20, 30, 40
    first = run_torchrun(config, tmp_path, name="first")
    assert first.proc.returncode == 0, first.output()[-3000:]
    uninterrupted = final_params(config["store"]["uri"])

    store = open_store(config["store"]["uri"])
    shard = f"{step_key(40)}/__0_0.distcp"
    data = bytearray(store.read_bytes(shard))
    data[len(data) // 2] ^= 0x01  # one flipped bit: only the read that loads it can tell
    store.write_bytes(shard, bytes(data))

    again = run_torchrun(config, tmp_path, name="again")
    assert again.proc.returncode == 0, again.output()[-3000:]  # main: exit 2, "already committed"
    assert [r["step"] for r in again.records("RESUMED")] == [30]
    assert [r["step"] for r in again.records("SAVING")] == [40]
    after = final_params(config["store"]["uri"])
    assert after.keys() == uninterrupted.keys() and all(torch.equal(after[k], uninterrupted[k]) for k in after)
    with CheckpointManager(store) as mgr:
        assert mgr.latest().step == 40 and mgr.verify(40, deep=True).step == 40
        [record] = mgr.quarantined()
        assert record["step"] == 40 and record["moved_to"] and "xxh3_128" in record["reason"]
