"""Corruption: each kind of damage is detected, by latest() when the manifest, a file or a size is
wrong (no data read) and by the read itself when bytes changed; either way the load falls back to the
previous good checkpoint, the damaged one is quarantined (a marker under checkpoints/quarantine/),
and nothing is deleted or overwritten."""

from __future__ import annotations

import json

import pytest

from relaunch.components.core.checkpoint import CheckpointManager, step_key
from relaunch.components.core.contract.errors import CorruptCheckpoint
from relaunch.components.core.store import open_store
from tests.core.helpers import backend_root, make_state, train_steps


def _flip_byte(store, key):
    data = bytearray(store.read_bytes(key))
    data[len(data) // 2] ^= 0xFF
    store.write_bytes(key, bytes(data))


def _truncate(store, key):
    store.write_bytes(key, store.read_bytes(key)[:-7])


def _bad_digest_manifest(store, key):
    manifest = json.loads(store.read_bytes(f"{key}/MANIFEST.json"))
    manifest["files"]["__0_0.distcp"]["chunks"][-1][2] = "0" * 32
    store.write_bytes(f"{key}/MANIFEST.json", json.dumps(manifest).encode())


DAMAGE = {
    "a flipped byte in a shard": lambda s, k: _flip_byte(s, f"{k}/__0_0.distcp"),
    "a truncated shard": lambda s, k: _truncate(s, f"{k}/__0_0.distcp"),
    "a truncated .metadata": lambda s, k: _truncate(s, f"{k}/.metadata"),
    "a missing manifest": lambda s, k: s.delete(f"{k}/MANIFEST.json"),
    "a manifest whose chunk digest does not match": _bad_digest_manifest,
    "a manifest of garbage JSON": lambda s, k: s.write_bytes(f"{k}/MANIFEST.json", b"{not json"),
    "latest.json pointing at a deleted directory": lambda s, k: s.delete_many(s.list(k + "/")),
    "latest.json of garbage JSON": lambda s, k: s.write_bytes("checkpoints/latest.json", b"\x00garbage"),
    "a missing shard": lambda s, k: s.delete(f"{k}/__0_0.distcp"),
}
POINTER_ONLY = {"latest.json of garbage JSON"}
FOUND_BY_THE_READ = {"a flipped byte in a shard"}  # an edited manifest no longer matches latest.json
# not damage of a committed checkpoint: no manifest (uncommitted debris), no directory, a bad pointer
NOT_QUARANTINED = POINTER_ONLY | {"a missing manifest", "latest.json pointing at a deleted directory"}


def _two_checkpoints(root):
    state = make_state()
    mgr = CheckpointManager(root, keep_last=0, owner="corrupt-test")
    train_steps(state, 2)
    mgr.save(2000, state)
    mgr.wait()
    good = [p.detach().clone() for p in state.model.parameters()]
    train_steps(state, 2)
    mgr.save(10000, state)
    mgr.wait()
    mgr.close()
    return good


@pytest.fixture(params=["fs", "s3", "gcs", "azure"])
def root(request, tmp_path):
    return backend_root(request, tmp_path, "corrupt")


@pytest.mark.parametrize("damage", list(DAMAGE), ids=list(DAMAGE))
def test_damage_is_detected_and_locate_falls_back_to_the_previous_good_checkpoint(root, damage):
    good = _two_checkpoints(root)
    store = open_store(root)
    DAMAGE[damage](store, step_key(10000))
    files_before = {k: store.read_bytes(k) for k in store.list()}
    mgr = CheckpointManager(root)
    info = mgr.latest()
    if damage in POINTER_ONLY:
        assert info.step == 10000  # the pointer is a hint: the newest valid checkpoint is found anyway
    else:
        # changed bytes pass the O(1) check of latest(); the read that loads them refuses them
        assert info.step == (10000 if damage in FOUND_BY_THE_READ else 2000)
        with pytest.raises(CorruptCheckpoint):
            mgr.verify(10000)
        state = make_state(seed=5)
        assert mgr.load(state).step == 2000
        assert all((a == b).all() for a, b in zip(state.model.parameters(), good))
    mgr.close()
    after = {k: store.read_bytes(k) for k in store.list()}
    added = sorted(set(after) - set(files_before))
    assert {k: after.get(k) for k in files_before} == files_before  # reading never deletes or overwrites
    if damage in NOT_QUARANTINED:
        assert added == []
    else:
        assert len(added) == 1 and added[0].startswith("checkpoints/quarantine/step-000000010000-"), added
        assert json.loads(after[added[0]])["step"] == 10000


def test_an_explicit_load_of_a_corrupt_checkpoint_raises_instead_of_loading(tmp_path):
    root = str(tmp_path / "store")
    _two_checkpoints(root)
    _flip_byte(open_store(root), f"{step_key(10000)}/__0_0.distcp")
    with pytest.raises(CorruptCheckpoint, match="xxh3_128"):
        CheckpointManager(root).load(make_state(), step=10000)


def test_retention_after_corruption_never_deletes_a_committed_checkpoint(tmp_path):
    root = str(tmp_path / "store")
    _two_checkpoints(root)
    store = open_store(root)
    _flip_byte(store, f"{step_key(10000)}/__0_0.distcp")
    damaged = {k: store.read_bytes(k) for k in store.list(step_key(10000) + "/")}
    state = make_state()
    mgr = CheckpointManager(root, keep_last=0, owner="corrupt-test")
    mgr.load(state)
    mgr.save(10001, state)
    mgr.wait()
    assert [i.step for i in mgr.list()] == [2000, 10001]  # the damaged one is no longer offered
    assert [(r["step"], r["moved_to"]) for r in mgr.quarantined()] == [(10000, None)]
    assert {k: store.read_bytes(k) for k in store.list(step_key(10000) + "/")} == damaged  # kept as found
    mgr.close()
