"""The guardian of a run (pipelines/local/guardian.py) with real processes: a process inside
``interruptible()`` (what ``relaunch run`` runs in) starts a child that double-forks a grandchild into a
session of its own and leaves it orphaned (as a torchrun agent's worker ends up when the launch step dies);
SIGKILL of that process ends the grandchild too (once the run is dead, no tree holds it), and an orderly
end leaves no guardian behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the guardian reads /proc (Linux)")

RUN = textwrap.dedent("""
    import os, subprocess, sys, time
    from relaunch.pipelines.local.interrupt import interruptible

    with interruptible():
        # a child that puts a grandchild in its own session and exits: an orphan no tree walk finds
        subprocess.run([sys.executable, "-c", "import subprocess, sys; subprocess.Popen(['sleep', '300'], "
                        "start_new_session=True); print(flush=True)"], check=True)
        print("ready", flush=True)
        if sys.argv[1] == "wait":
            time.sleep(300)
""")
DEADLINE = 5.0  # a bound for a hang, not a timed assertion


def _sleepers(token_of: int) -> list[psutil.Process]:
    """The `sleep 300` processes whose environment carries the run token of process ``token_of``."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if p.info["cmdline"] == ["sleep", "300"] and p.environ().get("RELAUNCH_RUN_TOKEN", "").startswith(f"{token_of}-"):
                found.append(p)
        except psutil.Error:
            pass
    return found


def _start(mode: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", RUN, mode], stdout=subprocess.PIPE, text=True, start_new_session=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert proc.stdout.readline().strip() == "" and proc.stdout.readline().strip() == "ready"
    return proc


def _gone_within(processes: list[psutil.Process], seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in processes if psutil.pid_exists(p.pid)):
            return True
        time.sleep(0.05)
    return False


def _command(process: psutil.Process) -> str:
    """Its command line; "" for a child that already ended (a zombie has none)."""
    try:
        return " ".join(process.cmdline())
    except psutil.Error:
        return ""


def test_sigkill_of_the_run_ends_an_orphan_in_a_session_of_its_own():
    proc = _start("wait")
    orphans = _sleepers(proc.pid)
    try:
        assert len(orphans) == 1
        proc.kill()
        proc.wait()
        assert _gone_within(orphans, DEADLINE), [o.pid for o in orphans]
    finally:
        for orphan in orphans:
            if orphan.is_running():
                orphan.kill()


def test_an_orderly_end_sweeps_what_is_left_and_leaves_no_guardian():
    proc = _start("end")
    guardians = [p for p in psutil.Process(proc.pid).children() if "guardian.py" in _command(p)]
    orphans = _sleepers(proc.pid)
    try:
        assert proc.wait(60) == 0 and len(guardians) == 1
        assert _gone_within(orphans, DEADLINE) and _gone_within(guardians, DEADLINE)
    finally:
        for p in orphans:
            if p.is_running():
                p.kill()


def test_a_kill_of_the_runs_whole_process_group_does_not_reach_the_guardian_which_ends_the_orphan():
    proc = _start("wait")
    orphans = _sleepers(proc.pid)
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the run leads its group; its guardian is in a session of its own
        proc.wait()
        assert _gone_within(orphans, DEADLINE)
    finally:
        for p in orphans:
            if p.is_running():
                p.kill()
