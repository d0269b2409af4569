"""Two writers on one root (a pipeline started twice): the second is refused while the first holds
the lease, takes over only after it expires, and the two histories never interleave."""

from __future__ import annotations

import json
import time

import pytest

from components.core.checkpoint import LEASE, CheckpointManager
from components.core.contract.errors import BadInput
from components.core.store import open_store
from tests.core.helpers import make_state, s3_root, train_steps


@pytest.fixture(params=["fs", "s3"])
def root(request, tmp_path):
    if request.param == "fs":
        return str(tmp_path / "store")
    return s3_root(request.getfixturevalue("s3_env"), "lease")


def test_a_second_writer_is_refused_while_the_first_holds_the_lease(root):
    first = CheckpointManager(root, owner="run-a", lease_seconds=60)
    second = CheckpointManager(root, owner="run-b", lease_seconds=60)
    state = make_state()
    first.save(1, state)
    first.wait()
    with pytest.raises(BadInput, match=r"being written by 'run-a'.*refusing a second writer"):
        second.save(2, state)
    train_steps(state, 1)
    first.save(3, state)
    assert first.wait().step == 3
    history = [i.step for i in CheckpointManager(root).list()]
    assert history == [1, 3]  # nothing of run-b's in between
    assert json.loads(open_store(root).read_bytes("checkpoints/latest.json"))["step"] == 3
    first.close()
    second.close()


def test_an_expired_lease_is_taken_over_and_the_old_writer_is_then_refused(root):
    first = CheckpointManager(root, owner="run-a", lease_seconds=0.5)
    state = make_state()
    first.save(1, state)
    first.wait()
    time.sleep(0.6)
    second = CheckpointManager(root, owner="run-b", lease_seconds=60)
    second.save(2, state)
    assert second.wait().step == 2
    first.save(3, state)  # the renewal runs in the background: its refusal surfaces at wait()
    with pytest.raises(BadInput, match="lost the write lease"):
        first.wait()
    assert [i.step for i in second.list()] == [1, 2]
    second.close()


def test_the_same_run_restarted_retakes_its_lease_at_once_and_close_releases_it(root):
    state = make_state()
    crashed = CheckpointManager(root, owner="run-a", lease_seconds=300)
    crashed.save(1, state)
    crashed.wait()  # ... and the process dies without close()
    restarted = CheckpointManager(root, owner="run-a", lease_seconds=300)
    restarted.save(2, state)
    assert restarted.wait().step == 2
    restarted.close()
    assert not open_store(root).exists(LEASE)
    other = CheckpointManager(root, owner="run-b")
    other.save(3, state)
    assert other.wait().step == 3
    other.close()


def test_readers_never_take_the_lease(root):
    writer = CheckpointManager(root, owner="run-a")
    state = make_state()
    writer.save(1, state)
    writer.wait()
    reader = CheckpointManager(root, owner="someone-else")
    assert reader.latest().step == 1
    reader.load(make_state())
    reader.close()
    assert json.loads(open_store(root).read_bytes(LEASE))["owner"] == "run-a"
    writer.close()
