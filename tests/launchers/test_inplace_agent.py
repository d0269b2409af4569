"""The in-place agent with stand-in workers (:mod:`tests.launchers.inplace_worker`): a killed worker is
replaced while the others keep their processes; any other failure takes the whole-group path and its
code; a SIGTERM of the agent reaches the workers and ends it with their code, restarting nothing."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from relaunch.components.launchers.inplace import _dying

ROOT = Path(__file__).resolve().parents[2]


def start(mode: str, nproc: int = 3) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "relaunch.components.launchers.inplace", f"--nproc-per-node={nproc}",
                             "--max-restarts=1", "-m", "tests.launchers.inplace_worker", mode],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_a_killed_worker_is_replaced_and_the_others_keep_their_processes():
    agent = start("kill")
    out, _ = agent.communicate(timeout=120)
    assert agent.returncode == 0, out
    first = dict(re.findall(r"worker rank=(\d) pid=(\d+) generation=0", out))
    rejoined = dict(re.findall(r"worker rank=(\d) pid=(\d+) rejoined generation=1", out))
    assert rejoined == {"0": first["0"], "2": first["2"]}, out  # survivors: the same processes, next generation
    replacement = re.findall(r"worker rank=1 pid=(\d+) generation=1", out)
    assert replacement and replacement[0] != first["1"], out
    assert "rank 1 (pid" in out and "killed (-9)" in out


def test_a_bad_input_of_one_worker_stops_the_group_with_its_code_and_restarts_nothing():
    agent = start("bad")
    out, _ = agent.communicate(timeout=120)
    assert agent.returncode == 2, out
    assert "generation=1" not in out and "rank 1 ended with 2: stopping the group" in out


def test_a_sigterm_of_the_agent_reaches_every_worker_and_ends_it_with_their_code():
    agent = start("preempt", nproc=2)
    deadline = time.monotonic() + 60
    seen = ""
    while seen.count("worker rank=") < 2 and time.monotonic() < deadline:
        seen += agent.stdout.readline()
    time.sleep(0.5)  # both installed their handlers
    agent.send_signal(signal.SIGTERM)
    out, _ = agent.communicate(timeout=60)
    assert agent.returncode == 143, seen + out
    assert "generation=1" not in seen + out


def test_a_worker_killed_but_not_yet_reaped_counts_as_dying_and_a_running_one_does_not():
    proc = subprocess.Popen(["sleep", "30"])
    try:
        time.sleep(0.05)
        assert not _dying(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)
        assert _dying(proc.pid)  # its SIGKILL pending, exiting, or a zombie: the agent waits for it
    finally:
        proc.kill()
        proc.wait()
    assert not _dying(proc.pid)  # reaped: gone from /proc
