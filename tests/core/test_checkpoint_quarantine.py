"""Damage is isolated, never fatal: a checkpoint found damaged is quarantined (recorded under
checkpoints/quarantine/, never chosen again, not counted by retention, shown as damaged by the CLI),
the training that fell back writes its step again, and the manifest is covered by its own digest,
checked by every reader (docs/checkpoint-format.md, "Manifest digest" and "Quarantine")."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from relaunch.components.core.checkpoint import CheckpointManager, step_key
from relaunch.components.core.checkpoint import quarantine
from relaunch.components.core.contract.errors import BadInput, CorruptCheckpoint
from relaunch.components.core.store import open_store
from relaunch.pipelines.cli import main
from tests.core.helpers import make_state, s3_root, train_steps


def _flip_byte(store, step):
    key = f"{step_key(step)}/__0_0.distcp"
    data = bytearray(store.read_bytes(key))
    data[len(data) // 2] ^= 0x01
    store.write_bytes(key, bytes(data))


def _truncate(store, step):
    key = f"{step_key(step)}/__0_0.distcp"
    store.write_bytes(key, store.read_bytes(key)[:-5])


def _edit_metric(store, step):
    """What a person or a script might do: change a value, still valid JSON, same layout."""
    key = f"{step_key(step)}/MANIFEST.json"
    manifest = json.loads(store.read_bytes(key))
    manifest["metrics"]["val_loss"] = 0.0001
    store.write_bytes(key, json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode())


def _delete_shard(store, step):
    store.delete(f"{step_key(step)}/__0_0.distcp")


def _garbage_manifest(store, step):
    store.write_bytes(f"{step_key(step)}/MANIFEST.json", b'{"format_version": 2, "step": ')


DAMAGE = {
    "a flipped bit": _flip_byte,
    "a truncated file": _truncate,
    "an edited manifest": _edit_metric,
    "a missing file": _delete_shard,
    "a manifest of garbage": _garbage_manifest,
}


@pytest.fixture(params=["fs", "s3"])
def root(request, tmp_path):
    if request.param == "fs":
        return str(tmp_path / "store")
    return s3_root(request.getfixturevalue("s3_env"), "quarantine")


def _history(root, steps, **kwargs):
    """Save ``steps`` (val_loss = step / 100) with a fresh manager; returns the state."""
    state = make_state()
    with CheckpointManager(root, owner="quarantine-test", **kwargs) as mgr:
        for step in steps:
            train_steps(state, 1)
            mgr.save(step, state, metrics={"val_loss": step / 100})
            mgr.wait()
    return state


def _marker_steps(store):
    return sorted(r["step"] for r in quarantine.records(store) if r["moved_to"] is None)


@pytest.mark.parametrize("damage", list(DAMAGE), ids=list(DAMAGE))
def test_the_training_falls_back_writes_the_damaged_step_again_and_goes_on(root, damage):
    _history(root, [10, 20, 30], keep_last=0)
    store = open_store(root)
    DAMAGE[damage](store, 30)
    state = make_state(seed=3)
    with CheckpointManager(root, owner="quarantine-test", keep_last=0) as mgr:
        assert mgr.load(state).step == 20
        for step in (30, 40):
            train_steps(state, 1)
            mgr.save(step, state, metrics={"val_loss": 0.5})  # main raised "already committed" at 30
            mgr.wait()
        assert mgr.latest().step == 40
        assert [i.step for i in mgr.list()] == [10, 20, 30, 40]
        moved = mgr.quarantined()
        assert [(r["step"], r["moved_to"] is not None) for r in moved] == [(30, True)], moved
    fresh = make_state(seed=4)
    with CheckpointManager(root) as reader:
        assert reader.load(fresh, step=30).step == 30  # the new step 30, whole
        assert reader.verify(30, deep=True).step == 30
    assert _marker_steps(store) == []
    kept = [k for k in store.list("checkpoints/quarantine/") if k.endswith("/QUARANTINE.json")]
    assert len(kept) == 1 and json.loads(store.read_bytes(kept[0]))["step"] == 30
    if not root.startswith("s3://"):  # a filesystem keeps the damaged bytes for inspection
        folder = kept[0].rsplit("/", 1)[0]
        assert store.exists(f"{folder}/MANIFEST.json") and store.exists(f"{folder}/.metadata")


@pytest.mark.parametrize("damage", ["a flipped bit", "a truncated file", "an edited manifest", "a missing file"])
def test_retention_keeps_the_intact_older_checkpoint_when_a_newer_one_is_damaged(root, damage):
    state = _history(root, [10, 20], keep_last=2)
    store = open_store(root)
    DAMAGE[damage](store, 20)
    if damage == "a flipped bit":  # only a read finds it: a reader does, before the writer's next save
        with CheckpointManager(root) as reader, pytest.raises(CorruptCheckpoint):
            reader.verify(20, deep=True)
    with CheckpointManager(root, owner="quarantine-test", keep_last=2) as mgr:
        train_steps(state, 1)
        mgr.save(30, state)
        mgr.wait()
        assert [i.step for i in mgr.list()] == [10, 30]  # main deleted 10, the only intact older one
        assert [r["step"] for r in mgr.quarantined()] == [20]
    assert store.exists(f"{step_key(20)}/.metadata")  # the damaged one stays for inspection


def _reader_latest(root):
    store = open_store(root)
    store.delete("checkpoints/latest.json")  # the pointer is only a hint: the listing must refuse 20 too
    store.delete("checkpoints/inflight.json")
    with CheckpointManager(root) as mgr:
        assert mgr.latest().step == 10


def _reader_load_step(root):
    with CheckpointManager(root) as mgr, pytest.raises(CorruptCheckpoint, match="manifest_digest"):
        mgr.load(make_state(), step=20)


def _reader_best(root):
    with CheckpointManager(root) as mgr:
        assert mgr.best("val_loss", "min").step == 10


def _reader_list(root):
    with CheckpointManager(root) as mgr:
        assert [i.step for i in mgr.list()] == [10]


def _reader_verify(root):
    with CheckpointManager(root) as mgr, pytest.raises(CorruptCheckpoint, match="manifest_digest"):
        mgr.verify(20, deep=False)


def _reader_verify_deep(root):
    with CheckpointManager(root) as mgr, pytest.raises(CorruptCheckpoint, match="manifest_digest"):
        mgr.verify(20, deep=True)


def _retention(**kwargs):
    def run(root):
        state = make_state()
        with CheckpointManager(root, owner="quarantine-test", **kwargs) as mgr:
            train_steps(state, 1)
            mgr.save(30, state, metrics={"val_loss": 0.9})
            mgr.wait()
            assert [i.step for i in mgr.list()] == [10, 30]  # 10: the real best / the intact older one
        assert open_store(root).exists(f"{step_key(20)}/.metadata")
    return run


READERS = {
    "latest": _reader_latest,
    "load(step=)": _reader_load_step,
    "best": _reader_best,
    "list": _reader_list,
    "verify": _reader_verify,
    "verify --deep": _reader_verify_deep,
    "retention keep_last": _retention(keep_last=2),
    "retention keep_best": _retention(keep_last=1, keep_best=1, best_metric="val_loss"),
}


@pytest.mark.parametrize("reader", list(READERS), ids=list(READERS))
def test_an_edited_manifest_is_caught_by_every_reader_and_quarantined(tmp_path, reader):
    root = str(tmp_path / "store")
    _history(root, [10, 20], keep_last=0)
    store = open_store(root)
    _edit_metric(store, 20)  # 0.0001: it would be the best, and the latest
    READERS[reader](root)
    assert _marker_steps(store) == [20]
    record = quarantine.records(store)[0]
    assert "manifest_digest" in record["reason"] and record["found_by"]


def test_list_and_verify_show_a_damaged_checkpoint_as_damaged(tmp_path, capsys):
    root = str(tmp_path / "store")
    _history(root, [10, 20, 30], keep_last=0)
    store = open_store(root)
    _truncate(store, 20)
    assert main(["checkpoints", "list", "--store", root, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["status"]) for r in rows] == [(10, "ok"), (20, "damaged"), (30, "ok")]
    assert "truncated" in rows[1]["reason"] and rows[1]["moved_to"] is None
    assert main(["checkpoints", "list", "--store", root]) == 0
    table = capsys.readouterr().out
    assert "damaged" in table and "ok" in table
    assert main(["checkpoints", "verify", "--store", root, "--step", "20", "--json"]) == 2
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["ok"] is False and out["status"] == "damaged" and "quarantined" in out["error"]
    assert "quarantined as damaged" in captured.err and len(captured.err.strip().splitlines()) == 1


def test_a_quarantine_marker_is_written_once_and_never_overwritten(tmp_path):
    store = open_store(str(tmp_path / "store"))
    assert quarantine.record(store, 7, "ab" * 32, "first finder", found_by="a") is True
    assert quarantine.record(store, 7, "ab" * 32, "second finder", found_by="b") is False
    [rec] = quarantine.records(store)
    assert rec["reason"] == "first finder" and rec["found_by"] == "a"


def test_a_marker_of_an_older_manifest_of_the_step_does_not_quarantine_a_new_checkpoint(tmp_path):
    root = str(tmp_path / "store")
    _history(root, [10], keep_last=0)
    store = open_store(root)
    quarantine.record(store, 10, "cd" * 32, "a checkpoint of step 10 moved aside long ago", found_by="x")
    with CheckpointManager(root) as mgr:
        assert mgr.latest().step == 10 and [i.step for i in mgr.list()] == [10]


def test_a_format_2_manifest_without_its_own_digest_still_loads_and_is_not_quarantined(tmp_path):
    # the fixture was written by the first format-2 release, before manifests carried their digest
    fixture = Path(__file__).parent / "fixtures" / "v2-store"
    shutil.copytree(fixture, tmp_path / "store")
    store = open_store(str(tmp_path / "store"))
    assert "manifest_digest" not in json.loads(store.read_bytes(f"{step_key(2)}/MANIFEST.json"))
    with CheckpointManager(str(tmp_path / "store"), owner="v2-test", async_save=False) as mgr:
        assert mgr.latest().step == 2 and mgr.verify(2, deep=True).step == 2
    assert quarantine.records(store) == []


def test_a_format_3_manifest_without_its_own_digest_is_damage(tmp_path):
    root = str(tmp_path / "store")
    _history(root, [10, 20], keep_last=0)
    store = open_store(root)
    key = f"{step_key(20)}/MANIFEST.json"
    manifest = json.loads(store.read_bytes(key))
    assert manifest["format_version"] == 3
    del manifest["manifest_digest"]
    store.write_bytes(key, json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode())
    with CheckpointManager(root) as mgr:
        assert mgr.latest().step == 10
    assert [r["step"] for r in quarantine.records(store)] == [20]


def test_an_intact_committed_step_is_still_never_overwritten(tmp_path):
    root = str(tmp_path / "store")
    state = _history(root, [10], keep_last=0)
    with CheckpointManager(root, owner="quarantine-test") as mgr:
        mgr.save(10, state)
        with pytest.raises(BadInput, match="already committed"):
            mgr.wait()


@pytest.mark.slow
@pytest.mark.parametrize("root", ["fs", pytest.param("s3", marks=pytest.mark.ci_lane)], indirect=True)  # s3: the fs case
# in make test proves the quarantine's part; S3's, a crash at any of its operations: test_checkpoint_crash's S3 cases
def test_a_crash_at_any_operation_of_saving_a_damaged_step_again_leaves_a_store_that_goes_on(root, tmp_path):
    from tests.core.faults import FaultyStore, InjectedCrash

    def damaged_store():
        r = root if not root.startswith("s3://") else f"{root}-{next(counter)}"
        if not r.startswith("s3://"):
            r = str(tmp_path / f"s{next(counter)}")
        _history(r, [10, 20], keep_last=2)
        _truncate(open_store(r), 20)
        return r

    def resave(store):
        state = make_state(seed=3)
        with CheckpointManager(store, owner="quarantine-test", keep_last=2) as mgr:
            assert mgr.load(state).step == 10
            loaded = len(store.ops)
            train_steps(state, 1)
            mgr.save(20, state)
            mgr.wait()
        return loaded

    counter = iter(range(10**6))
    probe = FaultyStore(open_store(damaged_store()))
    loaded = resave(probe)  # crashes are injected from the save on: the load found the damage
    total = len(probe.ops)
    assert any(op.startswith("delete(") for op in probe.ops[loaded:])  # the old step 20 was moved aside
    failures = []
    for k in range(loaded + 1, total + 1):
        r = damaged_store()
        store = FaultyStore(open_store(r), crash_at=k)
        try:
            resave(store)
        except InjectedCrash:
            pass
        try:
            with CheckpointManager(r, owner="quarantine-test", keep_last=2) as mgr:
                state = make_state(seed=4)
                info = mgr.load(state)
                assert info.step in (10, 20), info
                if info.step == 10:  # the crash came before the new step 20 was committed
                    train_steps(state, 1)
                    mgr.save(20, state)
                    mgr.wait()
                assert mgr.latest().step == 20 and mgr.verify(20, deep=True).step == 20
                assert [i.step for i in mgr.list()] == [10, 20]
        except (AssertionError, CorruptCheckpoint, BadInput) as err:
            failures.append(f"k={k} ({store.ops[k - 1]}): {err!r}")
    assert not failures, "\n".join(failures)
