"""A store that is full or read-only, on a real tmpfs (tests/core/store_tmpfs.py): the failure is the
contract's StoreUnwritable (exit 2), a new writer is refused in one line, a failed save leaves no partial
step and keeps the last committed checkpoint, and inspection reads such a store."""

from __future__ import annotations

import errno
import json

import pytest
import torch

from relaunch.components.core.checkpoint import CheckpointManager, commit, step_key
from relaunch.components.core.contract.classify import CarriedError, as_error, classify, is_store_unwritable
from relaunch.components.core.contract.errors import StoreUnwritable
from relaunch.components.core.contract.exitcodes import ExitCode
from relaunch.components.core.store import FileStore, probe_writable
from relaunch.pipelines.cli import main
from tests.core.helpers import assert_bitwise_equal, fingerprint, make_state, train_steps
from tests.core.store_tmpfs import mounted_tmpfs


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EROFS])
def test_a_full_or_read_only_store_is_store_unwritable_exit_2_on_every_rank(code):
    err = OSError(code, "the store's refusal")
    assert classify(err) == ExitCode.BAD_INPUT
    assert isinstance(as_error(err), StoreUnwritable)
    carried = CarriedError.of(err)  # what another rank of the save receives
    assert carried.kind == "store-unwritable" and isinstance(carried.rebuild("rank 0: "), StoreUnwritable)
    assert not is_store_unwritable(OSError(errno.EIO, "an I/O error"))  # not every OSError is the store's fullness


def test_the_write_probe_refuses_a_full_and_then_a_read_only_store_in_one_line_and_writes_nothing():
    with mounted_tmpfs("1m") as fs:
        (fs.path / "store").mkdir()
        store = FileStore(fs.path / "store")
        probe_writable(store)  # writable: nothing to say, nothing left
        assert store.list() == [] and list((fs.path / "store").iterdir()) == []
        fs.fill()
        with pytest.raises(StoreUnwritable) as full:
            probe_writable(store)
        fs.unfill()
        fs.remount_read_only()
        with pytest.raises(StoreUnwritable) as read_only:
            probe_writable(store)
    for refused, why in ((full, "it is full"), (read_only, "it is read-only")):
        line = str(refused.value)
        assert len(line.splitlines()) == 1 and str(store.uri) in line and why in line, line
        assert refused.value.exit_code == ExitCode.BAD_INPUT


def test_a_save_that_runs_out_of_space_leaves_no_partial_step_and_the_next_one_commits_once_space_is_back(monkeypatch):
    monkeypatch.setattr(commit, "FILE_BYTES", 128 * 1024)  # several files: some are complete when space runs out
    with mounted_tmpfs("4m") as fs:
        uri = str(fs.path / "store")
        state = make_state(width=256)  # ~0.8 MB a checkpoint: more than is left free below
        mgr = CheckpointManager(uri, keep_last=1, async_save=False)
        train_steps(state, 1)
        mgr.save(1, state)
        committed = fingerprint(state)
        train_steps(state, 1)
        fs.leave_free(64 * 1024)  # the lease and inflight.json fit, the data files do not
        with pytest.raises(Exception) as failed:
            mgr.save(2, state)
        assert is_store_unwritable(failed.value), failed.value
        assert mgr.store.list(step_key(2) + "/") == []  # what the failed save wrote is gone
        assert [i.step for i in mgr.list()] == [1] and mgr.latest().step == 1  # nothing committed was deleted
        restored = make_state(seed=1, width=256)
        mgr.load(restored)
        assert_bitwise_equal(fingerprint(restored)["params"], committed["params"])
        fs.unfill()
        mgr.save(3, state)  # space is back: the next save commits (and retention keeps only it)
        assert [i.step for i in mgr.list()] == [3]
        mgr.close()


def _two_checkpoints(uri: str) -> None:
    with CheckpointManager(uri, keep_last=0, async_save=False) as mgr:
        state = make_state()
        for step in (10, 20):
            train_steps(state, 1)
            mgr.save(step, state, metrics={"val_loss": 1.0 / step})


@pytest.mark.parametrize("fault", ["read-only", "full"])
def test_list_latest_verify_and_export_read_a_store_that_cannot_be_written(fault, tmp_path, capsys):
    with mounted_tmpfs("4m") as fs:
        uri = str(fs.path / "store")
        _two_checkpoints(uri)
        before = sorted(p.relative_to(fs.path).as_posix() for p in (fs.path / "store").rglob("*"))
        fs.remount_read_only() if fault == "read-only" else fs.fill()
        assert main(["checkpoints", "list", "--store", uri, "--json"]) == 0
        assert [r["step"] for r in json.loads(capsys.readouterr().out)] == [10, 20]
        assert main(["checkpoints", "latest", "--store", uri, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["step"] == 20
        assert main(["checkpoints", "verify", "--deep", "--store", uri, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["ok"] is True
        out = tmp_path / "state.pt"
        assert main(["checkpoints", "export", "--store", uri, "--to", str(out), "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["step"] == 20
        after = sorted(p.relative_to(fs.path).as_posix() for p in (fs.path / "store").rglob("*"))
    err = capsys.readouterr().err
    assert "Traceback" not in err and after == before, err
    assert all("cannot write a read lease" in line for line in err.strip().splitlines()), err
    assert set(torch.load(out, weights_only=True)) >= {"model"}


def test_an_object_store_that_refuses_writes_with_403_cannot_be_written_yet_is_read(s3_env, monkeypatch):
    from tests.core import faults
    from tests.core.helpers import s3_root

    root = s3_root(s3_env, "refused")
    _two_checkpoints(root)
    denied = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>AccessDenied</Code><Message>Access Denied'
              b"</Message><Resource>/</Resource><RequestId>proxy</RequestId><HostId>proxy</HostId></Error>")
    monkeypatch.setitem(faults._ANSWERS, "denied", (b"403 Forbidden", denied))
    proxy = faults.ScriptedProxy(s3_env.port, [("put /", "denied", None), ("post /", "denied", None)]).start()
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        with CheckpointManager(root, async_save=False) as mgr:
            with pytest.raises(StoreUnwritable, match="S3 refused put") as refused:
                probe_writable(mgr.store)  # what a training's start and prepare ask first
            assert refused.value.exit_code == ExitCode.BAD_INPUT and "cannot be written" in str(refused.value)
            assert [i.step for i in mgr.list()] == [10, 20] and mgr.latest().step == 20
            assert mgr.verify(20, deep=True).step == 20
    finally:
        proxy.stop()
