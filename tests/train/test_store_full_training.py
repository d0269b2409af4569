"""A training whose store fills, or is read-only, on a real tmpfs in a private mount namespace
(tests/core/store_tmpfs.py): the training goes on past a failed save and says so once; a store that
stays full stops it with exit 2 on every rank (never 137, never a restart loop), its last committed
checkpoint intact and loadable; space that comes back lets the next save commit; a read-only store is
refused before anything is written. ``relaunch run`` into a store that fills, and its advice followed:
tests/train/test_store_fills_midwrite.py."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import pytest

from relaunch.components.core.checkpoint.layout import LATEST, PREFIX, read_json
from relaunch.components.core.store import FileStore
from tests.cli import RELAUNCH, RUN_TIMEOUT, TINY, kill_agents
from tests.core.store_tmpfs import Tmpfs, mounted_tmpfs
from tests.train.conftest import ROOT, final_params, start_torchrun, train_config

NOT_SAVED = "not saved: store"


def _config(fs: Tmpfs, tmp_path, **train) -> dict:
    config = train_config(tmp_path, f"sqlite:///{tmp_path}/mlflow.db", hidden_size=32, checkpoint_every_steps=5,
                          step_sleep_seconds=0.1, **train)
    config["store"]["uri"] = f"{fs.dir}/store"  # the tmpfs, as the training (inside the namespace) sees it
    return config


def _first_commit(fs: Tmpfs, run, timeout: float = 180) -> int:
    """Wait for the training's first committed checkpoint; its step."""
    store = FileStore(fs.path / "store")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and run.proc.poll() is None:
        pointer = read_json(store, LATEST)
        if pointer:
            return int(pointer["step"])
        time.sleep(0.02)
    raise AssertionError(f"no checkpoint was committed; output:\n{run.output()[-3000:]}")


def _uncommitted_steps(fs: Tmpfs) -> list[str]:
    checkpoints = fs.path / "store" / PREFIX
    return [d.name for d in checkpoints.glob("step-*") if not (d / "MANIFEST.json").exists()]


def _said(output: str, text: str) -> int:
    """How many lines of the workers' own stderr say ``text`` (the same line also goes out as an event)."""
    return sum(text in line and "RELAUNCH_EVENT" not in line for line in output.splitlines())


def _worker_codes(output: str) -> list[int]:
    """The workers' codes torchrun printed (a worker it stopped because a faster one had ended: -15)."""
    return [int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", output)]


@pytest.mark.slow
def test_a_store_that_fills_during_a_training_stops_it_with_exit_2_after_three_failed_saves(tmp_path):
    with mounted_tmpfs("8m") as fs:
        run = start_torchrun(_config(fs, tmp_path, max_steps=200), tmp_path, max_restarts=2,
                             prefix=fs.inside([], cwd=ROOT))
        committed = _first_commit(fs, run)
        fs.fill()
        run.wait()
        out = run.output()
        assert _said(out, NOT_SAVED) == 1 and len(run.records("STORE")) == 1, out[-4000:]  # said once
        assert "peer worker was killed" not in out and 137 not in _worker_codes(out), out[-4000:]
        ending = run.records("EXIT")
        assert {e["exit_code"] for e in ending} == {2}, out[-4000:]
        # torchrun restarts a group whatever its code: each restart ends at once with the same cause
        assert {e["reason"] for e in ending} == {ending[0]["reason"]} and len(run.records("RESUMED")) == 1
        assert "failed in a row" in ending[0]["reason"] and f"{fs.dir}/store" in ending[0]["reason"]
        assert "No space left on device" in ending[0]["reason"]
        last = read_json(FileStore(fs.path / "store"), LATEST)["step"]
        assert last >= committed and _uncommitted_steps(fs) == []  # the failed saves left nothing behind
        assert final_params(str(fs.path / "store"))  # the last committed checkpoint loads


@pytest.mark.slow
def test_a_training_whose_store_gets_space_back_commits_its_next_save_and_finishes(tmp_path):
    with mounted_tmpfs("8m") as fs:
        run = start_torchrun(_config(fs, tmp_path, max_steps=60, store_unwritable_saves=6), tmp_path,
                             prefix=fs.inside([], cwd=ROOT))
        _first_commit(fs, run)
        fs.fill()
        deadline = time.monotonic() + 180
        while NOT_SAVED not in run.output() and run.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        fs.unfill()
        assert run.wait() == 0, run.output()[-4000:]
        out = run.output()
        assert _said(out, NOT_SAVED) == 1 and _said(out, "can be written again") == 1, out[-4000:]
        assert read_json(FileStore(fs.path / "store"), LATEST)["step"] == 60
        assert _uncommitted_steps(fs) == [] and final_params(str(fs.path / "store"))


@pytest.mark.slow
def test_a_training_on_a_read_only_store_is_refused_in_one_line_with_exit_2_and_writes_nothing(tmp_path):
    with mounted_tmpfs("1m") as fs:
        fs.remount_read_only()
        run = start_torchrun(_config(fs, tmp_path, max_steps=20), tmp_path, max_restarts=2,
                             prefix=fs.inside([], cwd=ROOT))
        run.wait()
        out = run.output()
        assert list(fs.path.iterdir()) == []
    assert 137 not in _worker_codes(out) and not re.search(r'File ".*/components/', out), out[-4000:]
    ending = run.records("EXIT")
    assert {e["exit_code"] for e in ending} == {2} and len(run.records("RESUMED")) == 0, out[-4000:]
    assert f"{fs.dir}/store" in ending[0]["reason"] and "read-only" in ending[0]["reason"]
    assert len(ending[0]["reason"].splitlines()) == 1


def _relaunch_run(fs: Tmpfs, cwd, *args: str) -> subprocess.Popen:
    return subprocess.Popen(fs.inside([RELAUNCH, "run", *TINY, "--set", f"store.uri={fs.dir}/store", *args], cwd=cwd),
                            cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _ended(proc: subprocess.Popen, cwd, timeout: float = RUN_TIMEOUT) -> tuple[str, str]:
    """The output of ``relaunch run`` once it ends; past ``timeout`` it and its agents are killed, and the test fails."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        kill_agents(cwd)
        out, err = proc.communicate()
        pytest.fail(f"relaunch run did not end in {timeout} s:\n{out[-3000:]}\n{err[-3000:]}")


def test_relaunch_run_into_a_read_only_store_is_refused_in_one_line_with_exit_2_and_writes_nothing(tmp_path):
    with mounted_tmpfs("1m") as fs:
        fs.remount_read_only()
        proc = _relaunch_run(fs, tmp_path)
        out, err = _ended(proc, tmp_path)
        assert list(fs.path.iterdir()) == []
    assert proc.returncode == 2 and len(err.strip().splitlines()) == 1, out + err
    assert f"{fs.dir}/store" in err and "read-only" in err and list(tmp_path.iterdir()) == []
