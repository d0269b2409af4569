"""Retention reads no committed manifest twice (issue 42): the writer remembers the manifests it
committed or read under its write lease, and checks them against the listing retention makes anyway
(every file there, no quarantine marker); a step moved aside and written again is read anew."""

from __future__ import annotations

import collections
from typing import Any

import pytest

from relaunch.components.core.checkpoint import CheckpointManager, step_key
from relaunch.components.core.contract.errors import CorruptCheckpoint
from relaunch.components.core.store import open_store
from tests.core.helpers import make_state, s3_root, train_steps


class Counting:
    """The store, each call counted by (method, key): its answers unchanged."""

    def __init__(self, inner: Any):
        self._inner = inner
        self.calls: collections.Counter[tuple[str, str]] = collections.Counter()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls[(name, args[0] if args and isinstance(args[0], str) else "")] += 1
            return attr(*args, **kwargs)

        return call

    def manifest_reads(self) -> dict[str, int]:
        return {k: n for (m, k), n in self.calls.items() if m == "read_bytes" and k.endswith("/MANIFEST.json")}


@pytest.fixture(params=["fs", "s3"])
def root(request, tmp_path):
    if request.param == "fs":
        return str(tmp_path / "store")
    return s3_root(request.getfixturevalue("s3_env"), "manifest-reads")


def test_six_saves_with_keep_last_2_read_each_committed_manifest_at_most_once(root):
    store = Counting(open_store(root))
    state = make_state()
    with CheckpointManager(store, keep_last=2, owner="manifest-reads") as mgr:
        for step in range(1, 7):
            train_steps(state, 1)
            mgr.save(step, state, metrics={"val_loss": 1 / step})
            mgr.wait()
        assert [i.step for i in mgr.list()] == [5, 6]
    reads = store.manifest_reads()
    assert all(n <= 1 for n in reads.values()), reads
    # the writer's own commits are remembered: retention itself read none of them
    assert not any(k.startswith(step_key(s)) for k in reads for s in range(1, 5)), reads


def _reader_finds_damage(root: str, step: int) -> None:
    store = open_store(root)
    key = f"{step_key(step)}/__0_0.distcp"
    store.write_bytes(key, store.read_bytes(key)[:-5])  # truncated: only the listing's sizes show it
    with CheckpointManager(root) as reader:
        with pytest.raises(CorruptCheckpoint):
            reader.verify(step, deep=False)  # the reader records the quarantine marker


def _file_deleted(root: str, step: int) -> None:
    open_store(root).delete(f"{step_key(step)}/__0_0.distcp")


@pytest.mark.parametrize("damage", [_reader_finds_damage, _file_deleted], ids=["a reader's marker", "a missing file"])
def test_a_remembered_manifest_damaged_since_is_not_counted_by_retention(root, damage):
    state = make_state()
    with CheckpointManager(root, keep_last=2, owner="manifest-reads") as mgr:
        for step in (10, 20, 30):
            train_steps(state, 1)
            mgr.save(step, state)
            mgr.wait()
        damage(root, 30)  # the writer remembers 30's manifest, committed by itself
        train_steps(state, 1)
        mgr.save(40, state)
        mgr.wait()
        # 30 does not count toward keep_last: 20 is kept with 40, and 30 stays for inspection
        assert [i.step for i in mgr.list()] == [20, 40]
        assert [r["step"] for r in mgr.quarantined()] == [30]
        assert mgr.store.exists(f"{step_key(30)}/.metadata")


def test_a_step_quarantined_and_written_again_is_not_served_from_what_was_remembered(root):
    state = make_state()
    with CheckpointManager(root, keep_last=1, keep_best=1, best_metric="val_loss", owner="manifest-reads") as mgr:
        for step, loss in ((10, 0.1), (20, 0.5)):
            train_steps(state, 1)
            mgr.save(step, state, metrics={"val_loss": loss})
            mgr.wait()
        _reader_finds_damage(root, 10)
        train_steps(state, 1)
        mgr.save(10, state, metrics={"val_loss": 0.9})  # moved aside, written again: a worse loss now
        mgr.wait()
        train_steps(state, 1)
        mgr.save(30, state, metrics={"val_loss": 0.7})
        mgr.wait()
        # the old manifest of 10 (0.1) would keep 10 as the best and delete 20; the new one (0.9) does not
        assert [(i.step, i.metrics["val_loss"]) for i in mgr.list()] == [(20, 0.5), (30, 0.7)]
