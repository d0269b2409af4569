"""The checkpoint manager's collaborators, each used alone on a real store with a few explicit
arguments: the committer and the loader, the locator, retention, the leases."""

from __future__ import annotations

import pytest

from relaunch.components.core.checkpoint.commit import Committer
from relaunch.components.core.checkpoint.layout import INFLIGHT, MANIFEST, checkpoint_steps, step_key
from relaunch.components.core.checkpoint.leases import Leases
from relaunch.components.core.checkpoint.load import Loader
from relaunch.components.core.checkpoint.locator import Locator
from relaunch.components.core.checkpoint.ranks import Ranks
from relaunch.components.core.checkpoint.retention import Retention
from relaunch.components.core.contract.errors import BadInput
from relaunch.components.core.store import open_store
from tests.core.helpers import assert_bitwise_equal, fingerprint, make_state, train_steps


class _Writer:
    """A committer and what it needs, wired by hand (what the manager does)."""

    def __init__(self, store, *, keep_last: int = 0):
        self.leases = Leases(store, "parts-test", seconds=60)
        self.locator = Locator(store, self.leases)
        self.committer = Committer(store, Ranks(), self.leases, self.locator, Retention(store, keep_last=keep_last),
                                   async_save=False)
        self.leases.take()
        self.committer.read_latest_pointer()

    def save(self, step: int, state) -> None:
        self.committer.save(step, state)

    def close(self) -> None:
        self.committer.close()
        self.leases.close()


def _commit(store, steps: list[int]):
    state = make_state()
    writer = _Writer(store)
    for step in steps:
        train_steps(state, 1)
        state.step = step
        writer.save(step, state)
    writer.close()
    return state


def test_a_committer_alone_commits_and_a_loader_alone_reads_the_state_back_bitwise(tmp_path):
    store = open_store(str(tmp_path / "store"))
    expected = fingerprint(_commit(store, [4]))  # now: the RNG streams are process-wide
    leases = Leases(store, "reader", seconds=60)
    fresh = make_state(seed=9)
    info = Loader(Locator(store, leases), Ranks()).load(fresh, store)
    leases.close()
    assert info.step == 4
    assert_bitwise_equal(fingerprint(fresh), expected)


def test_the_locator_alone_picks_the_committed_checkpoint_over_a_newer_partial_one(tmp_path):
    store = open_store(str(tmp_path / "store"))
    _commit(store, [2, 3])
    store.delete(f"{step_key(3)}/{MANIFEST}")  # step 3's files are all there, its commit point is not
    store.write_bytes(INFLIGHT, b'{"step": 3, "owner": "parts-test"}')
    leases = Leases(store, "reader", seconds=60)
    found = Locator(store, leases).latest()
    leases.close()
    assert checkpoint_steps(store)[-1] == 3 and found.step == 2


def test_retention_alone_keeps_the_last_intact_checkpoint_when_the_newest_is_damaged(tmp_path):
    store = open_store(str(tmp_path / "store"))
    _commit(store, [1, 2, 3])
    data = sorted(k for k in store.list(step_key(3) + "/") if k.endswith(".distcp"))[0]
    store.write_bytes(data, store.read_bytes(data)[:-1])  # truncated: step 3 is damaged
    locator = Locator(store, Leases(store, "pruner", seconds=60))
    deleted = Retention(store, keep_last=1).apply(in_flight=None, manifest=locator.manifest)
    # the damaged step does not count toward keep_last: step 2 is the one kept, step 3 stays for inspection
    assert deleted == [1] and checkpoint_steps(store) == [2, 3]
    assert [r["step"] for r in locator.quarantined()] == [3]


def test_leases_alone_refuse_a_second_writer_of_another_owner(tmp_path):
    store = open_store(str(tmp_path / "store"))
    first, second = Leases(store, "first", seconds=60), Leases(store, "second", seconds=60)
    first.take()
    try:
        with pytest.raises(BadInput):
            second.take()
    finally:
        first.close()
        second.close(release=False)


def test_a_retention_policy_that_cannot_be_applied_is_refused_before_any_store_is_touched(tmp_path):
    with pytest.raises(BadInput, match="keep_best needs best_metric"):
        Retention(open_store(str(tmp_path / "store")), keep_best=1)
