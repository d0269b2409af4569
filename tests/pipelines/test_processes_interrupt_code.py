"""Ctrl-C (SIGINT to the ``relaunch run`` process alone) at the hardest moment, as an asynchronous save
starts, on the cold path (every step a fresh interpreter under kfp.local's ``sh``): the preemption
checkpoint waits for it, then commits the step the training stopped at, and relaunch exits 143. The warm
path, the one ``relaunch run`` takes, is stopped the same way in tests/pipelines/test_interrupt.py's
``interrupted`` run, which make test runs."""

from __future__ import annotations

import os
import signal

import pytest

from relaunch.components.core.contract.exitcodes import ExitCode
from tests.pipelines.interrupting import RUN_TIMEOUT, SHORT, finish, kill_run, start, wait_for_save

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3 * RUN_TIMEOUT)]


@pytest.mark.ci_lane  # the warm case: test_interrupt.py's interrupted run (make test)
def test_ctrl_c_while_a_save_is_in_flight_on_the_cold_path_still_commits_the_step_it_stopped_at_and_exits_143(
        tmp_path):
    """Cold, relaunch used to wait for the step to finish training before it stopped anything."""
    proc = start(tmp_path, *SHORT, "--cold")
    try:
        wait_for_save(proc, tmp_path, 20)
    except AssertionError:
        kill_run(proc, tmp_path)
        raise
    os.kill(proc.pid, signal.SIGINT)
    code, out, err = finish(proc, tmp_path)
    from relaunch.components.core.store import open_store
    from relaunch.components.core.store.records import read_summary
    from tests.cli import newest_training

    summary = read_summary(open_store(newest_training(str(tmp_path / ".relaunch" / "store"))))
    assert summary["last_committed_step"] == summary["last_step"] >= 20, summary
    assert code == ExitCode.PREEMPTED, (code, err[-3000:], out[-2000:])
    assert f"checkpoint at step {summary['last_step']} committed" in err
