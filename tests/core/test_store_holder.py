"""Whether the process a lease or a lock names still runs: a killed process its parent has not reaped yet
(a zombie: PID 1 took 1-2 s to reap killed workers on this VM) holds nothing, so a resume need not wait for it."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from relaunch.components.core.store.holder import process_running, process_start


def test_a_killed_process_not_yet_reaped_is_not_running():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        started = process_start(child.pid)
        assert process_running(child.pid, started)
        child.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 30
        while open(f"/proc/{child.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < deadline, "the killed child never became a zombie"
            time.sleep(0.01)
        assert not process_running(child.pid, started) and not process_running(child.pid)
    finally:
        child.kill()
        child.wait()


def test_a_pid_reused_by_another_process_is_not_the_holder():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert process_running(child.pid) and not process_running(child.pid, started="1")
    finally:
        child.kill()
        child.wait()
    assert not process_running(child.pid)
