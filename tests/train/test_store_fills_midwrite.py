"""A store that fills in the middle of a tensor, and a collective that breaks while every peer lives.

On a real tmpfs (tests/core/store_tmpfs.py) left with less room than a tensor of the state: torch's zip
writer loses the ENOSPC of the payload's write inside its own ``RuntimeError: unexpected pos``; the save
still fails as a full store, on every rank alike, the way a save whose first write fails does: one line
naming the full disk, exit 2, nothing retried, the last commit intact and resumable, with recovery from
memory on (the in-place agent) and off (torchrun); the console says "not saved" once, and following the
advice (free space, then ``relaunch run --resume``) finishes the training. A rank that ends for a cause of
its own (a task's bug on one rank) ends its peers, whose collective it broke, with that cause at once: not
137, not a wait for a replacement that no launcher starts.
"""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import time

import pytest
import torch

from relaunch.components.core.checkpoint.layout import LATEST, PREFIX, read_json
from relaunch.components.core.store import FileStore
from relaunch.components.tasks.digits import DigitsTask
from tests.cli import RELAUNCH, TINY
from tests.core.store_tmpfs import Tmpfs, mounted_tmpfs
from tests.train.conftest import ROOT, final_params
from tests.train.test_store_full_training import _ended as ended

HIDDEN = 2048  # the digits MLP's first layer is then 64 x 2048 floats: 512 KiB, and AdamW's moments of it as much
LEFT_FREE = 128 * 1024  # less than that tensor, more than every small record of a save
ENDS_WITHIN = 240  # far below train.process_group_timeout_seconds below: waiting that out fails the test
ARGS = ("--set", f"train.hidden_size={HIDDEN}", "--set", "train.checkpoint_every_steps=5", "--set",
        "train.max_steps=60", "--set", "train.step_sleep_seconds=0.1", "--set", "train.process_group_timeout_seconds=900")


def test_a_tensor_larger_than_the_space_left_fails_its_write_with_enospc_and_leaves_no_file():
    from relaunch.components.core.checkpoint.dcp_io import StoreWriter
    from relaunch.components.core.contract.classify import is_store_unwritable
    import torch.distributed.checkpoint as dcp

    with mounted_tmpfs("2m") as fs:
        store = FileStore(fs.path / "store")
        fs.leave_free(LEFT_FREE)
        with pytest.raises(BaseException) as caught:  # DCP's CheckpointException (a BaseException)
            dcp.save({"w": torch.zeros(HIDDEN, 64)}, storage_writer=StoreWriter(store, "step-1"), no_dist=True)
        err = caught.value
        originals = [f[0] if isinstance(f, tuple) else f for f in getattr(err, "failures", {}).values()] or [err]
        assert any(isinstance(o, OSError) and o.errno == errno.ENOSPC for o in originals), repr(originals)
        assert is_store_unwritable(err) and "unexpected pos" not in str(err)
        assert not (fs.path / "store" / "step-1").exists()  # what it wrote is gone: the next save needs the room


def test_an_error_over_a_full_disk_is_the_full_disk_and_a_write_failing_without_errno_asks_the_store_for_room():
    from relaunch.components.core.checkpoint.dcp_io import write_failure
    from relaunch.components.core.contract.classify import classify, is_store_unwritable
    from relaunch.components.core.contract.exitcodes import ExitCode

    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    except RuntimeError as err:
        wrapped = err
    assert classify(wrapped) == ExitCode.BAD_INPUT and is_store_unwritable(wrapped)
    broken = torch.distributed.DistNetworkError("Connection closed by peer")
    broken.__context__ = OSError(errno.ENOSPC, "No space left on device")
    assert classify(broken) == ExitCode.RETRY_ME and not is_store_unwritable(broken)  # a collective is what it says
    without_errno = RuntimeError("unexpected pos 704 vs 598")  # the errno lost on the way
    with mounted_tmpfs("1m") as fs:
        store = FileStore(fs.path / "store")
        assert write_failure(store, "step-1/__0_0.distcp", without_errno, 512 * 1024) is without_errno  # room: a bug
        fs.fill()
        failure = write_failure(store, "step-1/__0_0.distcp", without_errno, 512 * 1024)
    assert isinstance(failure, OSError) and failure.errno == errno.ENOSPC and is_store_unwritable(failure)


def _relaunch_run(fs: Tmpfs, cwd, *args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(fs.inside([RELAUNCH, "run", *TINY, "--set", f"store.uri={fs.dir}/store", *args], cwd=cwd),
                            cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, **(env or {})})


def _ended(proc: subprocess.Popen, cwd) -> tuple[str, str]:
    return ended(proc, cwd, timeout=ENDS_WITHIN)


def _committed_step(fs: Tmpfs) -> int | None:
    for latest in fs.path.glob(f"store/trainings/*/{LATEST}"):
        return int(json.loads(latest.read_text())["step"])
    return None


def _wait_for_commit(fs: Tmpfs, proc: subprocess.Popen, step: int) -> None:
    while (_committed_step(fs) or -1) < step and proc.poll() is None:
        time.sleep(0.02)


def _pipeline_log(cwd) -> str:
    return "".join(p.read_text() for p in cwd.glob(".relaunch/runs/*/*/pipeline.log"))


@pytest.mark.slow
@pytest.mark.parametrize("memory_tier", ["true", "false"])
def test_a_store_that_fills_in_the_middle_of_a_tensor_ends_the_run_in_one_line_with_exit_2_retrying_nothing(
        tmp_path, memory_tier):
    with mounted_tmpfs("16m") as fs:
        proc = _relaunch_run(fs, tmp_path, *ARGS, "--set", f"train.memory_tier={memory_tier}")
        _wait_for_commit(fs, proc, 10)
        fs.leave_free(LEFT_FREE)  # the next save runs out of room inside a tensor's bytes
        out, err = _ended(proc, tmp_path)
        console, last = out + err, (err.strip().splitlines() or [""])[-1]
        assert proc.returncode == 2, console[-4000:]
        assert "No space left on device" in last and "cannot be written" in last and "relaunch run --resume" in last
        assert "unexpected pos" not in console and "peer worker" not in console and "recovering in place" not in console
        assert "↻" not in console and "exit 137" not in console, console[-4000:]
        assert out.count("not saved") == 1, out[-4000:]  # the first failed save, said once on the console
        assert _pipeline_log(tmp_path).count('"kind": "exit"') == 1  # one attempt: nothing retried
        committed = int(re.search(r"step (\d+), the last committed checkpoint, is intact", last).group(1))
        training = next(fs.path.glob("store/trainings/*"))
        assert read_json(FileStore(training), LATEST)["step"] == committed >= 10
        assert [d.name for d in (training / PREFIX).glob("step-*") if not (d / "MANIFEST.json").exists()] == []
        assert final_params(str(training), hidden_size=HIDDEN)  # the last commit loads
        if memory_tier == "true":  # and resumes, once the store has room again
            fs.unfill()
            proc = _relaunch_run(fs, tmp_path, *ARGS, "--set", f"train.memory_tier={memory_tier}", "--resume")
            out, err = _ended(proc, tmp_path)
            assert proc.returncode == 0 and f"resumed from step {committed}" in out, out[-3000:] + err[-3000:]


class OneRankFails(DigitsTask):
    """The digits task with a bug on the last rank: its third loss raises (the other ranks then wait for it in
    the step's collectives)."""

    calls = 0

    def loss(self, model, batch):
        self.calls += 1
        if self.calls == 3 and os.environ.get("RANK") == str(int(os.environ.get("WORLD_SIZE", "1")) - 1):
            raise ValueError("the task's own bug, on one rank")
        return super().loss(model, batch)


def one_rank_fails(config):
    return OneRankFails(config)


@pytest.mark.slow
@pytest.mark.parametrize("memory_tier", ["true", "false"])
def test_a_rank_that_fails_on_its_own_ends_its_living_peers_with_its_cause_not_as_a_killed_peer(tmp_path, memory_tier):
    with mounted_tmpfs("16m") as fs:  # the store on the tmpfs only to run as the test above does
        proc = _relaunch_run(fs, tmp_path, *ARGS, "--set", f"train.memory_tier={memory_tier}", "--set",
                             f"train.task={__name__}:one_rank_fails", env={"PYTHONPATH": str(ROOT)})
        out, err = _ended(proc, tmp_path)
    console, last = out + err, (err.strip().splitlines() or [""])[-1]
    assert proc.returncode == 1 and "the task's own bug, on one rank" in last, console[-4000:]
    assert "a peer worker was killed" not in console and "recovering in place" not in console, console[-4000:]
    assert "no next generation" not in console and "exit 137" not in console and "↻" not in console, console[-4000:]
    assert _pipeline_log(tmp_path).count('"kind": "exit"') == 1  # a bug is not retried
