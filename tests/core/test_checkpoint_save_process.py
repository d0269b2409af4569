"""An async save's CPU work runs in the manager's helper process (components/core/checkpoint/save_process.py),
never under the training's GIL; its failures keep the save's behaviour: a full store is StoreUnwritable
(exit 2) with nothing of the step left, a killed helper commits nothing and ends 137, the next save
commits with a new helper; what the helper cannot rebuild is written by the save's thread."""

from __future__ import annotations

import errno
import os
import signal
import sys
import threading
import types

import pytest
import torch

from relaunch.components.core.checkpoint import CheckpointManager, commit, save_process, step_key
from relaunch.components.core.contract.classify import is_store_unwritable
from relaunch.components.core.contract.exitcodes import ExitCode
from tests.core.helpers import assert_bitwise_equal, fingerprint, make_state, train_steps
from tests.core.store_tmpfs import mounted_tmpfs


@pytest.fixture(autouse=True)
def helper_up():
    """The process's helper started (the first save of a process writes on its thread while it starts)."""
    assert save_process.helper().ready(wait=True)


@pytest.fixture
def writes_here(monkeypatch):
    """The saves whose data this process wrote itself (save_process.dcp_write called here)."""
    calls: list[str] = []
    real = save_process.dcp_write

    def counted(store, key, *args, **kwargs):
        calls.append(key)
        return real(store, key, *args, **kwargs)

    monkeypatch.setattr(save_process, "dcp_write", counted)
    return calls


def test_an_async_save_is_written_by_the_helper_process_and_loads_back_bitwise(tmp_path, writes_here):
    state = make_state(width=64)
    with CheckpointManager(str(tmp_path / "store"), keep_last=2) as mgr:
        for step in (1, 2):
            train_steps(state, 1)
            mgr.save(step, state, defer_copy=step == 2)
            info = mgr.wait()
            assert info is not None and info.step == step
        helper = save_process.helper().pid
        saved = fingerprint(state)
    assert helper is not None and helper != os.getpid()
    assert writes_here == []  # no data file of either save was written by this process
    restored = make_state(seed=1, width=64)
    with CheckpointManager(str(tmp_path / "store"), owner="reader") as mgr:
        assert mgr.load(restored).step == 2
    assert_bitwise_equal(fingerprint(restored), saved)


def test_a_synchronous_save_is_written_on_its_own_thread(tmp_path, writes_here):
    state = make_state()
    with CheckpointManager(str(tmp_path / "sync"), async_save=False) as mgr:
        mgr.save(1, state)
    assert len(writes_here) == 1


def test_a_helper_killed_in_the_middle_of_a_save_commits_nothing_ends_137_and_the_next_save_commits(tmp_path,
                                                                                                   monkeypatch):
    waiting = threading.Event()  # the save handed its work over and waits for the helper's answer
    real = save_process._recv_frame

    def recv(sock):
        waiting.set()
        return real(sock)

    monkeypatch.setattr(save_process, "_recv_frame", recv)
    state = make_state(width=64)
    mgr = CheckpointManager(str(tmp_path / "store"), keep_last=3)
    try:
        mgr.save(1, state)
        mgr.wait()
        helper = save_process.helper().pid
        os.kill(helper, signal.SIGSTOP)  # the save below hands its work over, and waits for the answer
        train_steps(state, 1)
        waiting.clear()
        mgr.save(2, state)
        assert waiting.wait(60)
        os.kill(helper, signal.SIGKILL)
        with pytest.raises(Exception) as killed:
            mgr.wait()
        assert killed.value.exit_code == ExitCode.KILLED and "nothing of it was committed" in str(killed.value)
        assert not mgr.store.exists(f"{step_key(2)}/manifest.json")
        assert mgr.latest().step == 1 and [i.step for i in mgr.list()] == [1]
        assert save_process.helper().ready(wait=True)  # a new helper
        assert save_process.helper().pid not in (None, helper)
        mgr.save(3, state)
        assert mgr.wait().step == 3
        saved = fingerprint(state)
    finally:
        mgr.close()
    restored = make_state(seed=1, width=64)
    with CheckpointManager(str(tmp_path / "store"), owner="reader") as reader:
        assert reader.load(restored).step == 3
    assert_bitwise_equal(fingerprint(restored), saved)


def test_a_full_store_in_the_middle_of_a_helper_write_is_store_unwritable_and_leaves_no_partial_step(monkeypatch):
    monkeypatch.setattr(commit, "FILE_BYTES", 128 * 1024)  # several files: some are complete when space runs out
    with mounted_tmpfs("4m") as fs:
        state = make_state(width=256)  # ~0.8 MB a checkpoint: more than is left free below
        mgr = CheckpointManager(str(fs.path / "store"), keep_last=1)
        try:
            mgr.save(1, state)
            mgr.wait()
            assert save_process.helper().pid is not None
            train_steps(state, 1)
            fs.leave_free(64 * 1024)  # the lease and inflight.json fit, the data files do not
            mgr.save(2, state)
            with pytest.raises(Exception) as failed:
                mgr.wait()
            assert is_store_unwritable(failed.value), failed.value
            assert isinstance(failed.value, OSError) and failed.value.errno == errno.ENOSPC  # the cause, as a thread's
            assert mgr.store.list(step_key(2) + "/") == []
            assert [i.step for i in mgr.list()] == [1]
            fs.unfill()
            mgr.save(3, state)
            assert mgr.wait().step == 3
        finally:
            mgr.close()


def test_an_object_the_helper_cannot_rebuild_is_written_by_the_save_thread(tmp_path, writes_here, monkeypatch):
    here_only = types.ModuleType("relaunch_test_here_only")  # importable in this process, not in the helper

    class Marker:
        def __init__(self, n: int):
            self.n = n

    Marker.__module__ = here_only.__name__
    Marker.__qualname__ = "Marker"
    here_only.Marker = Marker
    monkeypatch.setitem(sys.modules, here_only.__name__, here_only)
    state = {"model": torch.nn.Linear(3, 2), "extra": {"marker": Marker(3)}}
    with CheckpointManager(str(tmp_path / "store")) as mgr:
        mgr.save(1, state)
        assert mgr.wait().step == 1
        assert save_process.helper().pid is not None  # the helper answered, and the thread wrote
    assert writes_here == [step_key(1)]
