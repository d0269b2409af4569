"""Ctrl-C (SIGINT to the ``relaunch run`` process alone) at the hardest moment, as an asynchronous save
starts: the preemption checkpoint waits for it, then commits the step the training stopped at, and
relaunch exits 143 (the same stop at an ordinary step: tests/pipelines/test_interrupt.py)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from relaunch.components.core.contract.exitcodes import ExitCode
from tests.pipelines.interrupting import RUN_TIMEOUT, SHORT, finish, saving, start

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3 * RUN_TIMEOUT)]


@pytest.mark.parametrize("mode", ["warm", pytest.param("cold", marks=pytest.mark.ci_lane)])  # cold: the warm case in make test
def test_ctrl_c_while_a_save_is_in_flight_still_commits_the_step_it_stopped_at_and_exits_143(tmp_path, mode):
    """The hardest moment: SIGINT as the asynchronous save of step 20 starts; the preemption checkpoint
    waits for it, then commits the step the training stopped at. Cold too (every step a fresh interpreter
    under kfp.local's ``sh``), where relaunch used to wait for the step to finish training before it
    stopped anything."""
    proc = start(tmp_path, *SHORT, *(["--cold"] if mode == "cold" else []))
    deadline = time.monotonic() + RUN_TIMEOUT  # a bound for a hang, not a timed assertion
    while not saving(tmp_path, 20):
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"the training never saved step 20: {finish(proc, tmp_path)}")
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGINT)
    code, out, err = finish(proc, tmp_path)
    from relaunch.components.core.store import open_store
    from relaunch.components.core.store.records import read_summary
    from tests.cli import newest_training

    summary = read_summary(open_store(newest_training(str(tmp_path / ".relaunch" / "store"))))
    assert summary["last_committed_step"] == summary["last_step"] >= 20, summary
    assert code == ExitCode.PREEMPTED, (code, err[-3000:], out[-2000:])
    assert f"checkpoint at step {summary['last_step']} committed" in err
