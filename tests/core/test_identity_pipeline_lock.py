"""The pipeline lock of a training (``runs/pipeline-lock.json``): refused while its holder lives (its pid
with the start time it recorded, on this host; its heartbeat, on another), taken over once it is gone."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from relaunch.components.core.store import open_store
from relaunch.components.core.store.holder import process_start
from relaunch.components.core.store.pipeline_lock import STALE_SECONDS, PipelineLock, TrainingInUse
from relaunch.components.core.store.records import PIPELINE_LOCK_KEY


@pytest.fixture
def sleeper():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    yield proc
    proc.kill()
    proc.wait()


def _record(pid: int, **fields) -> bytes:
    return json.dumps({"token": "other", "pid": pid, "host": socket.gethostname(),
                       "pid_namespace": str(os.stat("/proc/self/ns/pid").st_ino), "process_start": process_start(pid),
                       "command": "relaunch run", "started": time.time(), "heartbeat": time.time(), **fields}).encode()


def test_a_lock_held_by_a_live_process_is_refused_in_one_line_naming_its_pid_and_host(tmp_path, sleeper):
    store = open_store(str(tmp_path))
    store.write_bytes(PIPELINE_LOCK_KEY, _record(sleeper.pid))
    before = store.read_bytes(PIPELINE_LOCK_KEY)
    with pytest.raises(TrainingInUse) as refused:
        PipelineLock(store, "t1").take()
    line = str(refused.value)
    assert "\n" not in line and f"pid {sleeper.pid} on host {socket.gethostname()}" in line
    assert store.read_bytes(PIPELINE_LOCK_KEY) == before


@pytest.mark.parametrize("case", ["its process ended", "its pid was reused", "another host stopped beating"])
def test_a_lock_whose_holder_is_gone_is_taken_over_and_released(tmp_path, sleeper, case):
    store = open_store(str(tmp_path))
    if case == "its process ended":
        done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
        record = _record(int(done.stdout))
    elif case == "its pid was reused":
        record = _record(sleeper.pid, process_start="1")  # the pid runs, but it is not the process that wrote it
    else:
        record = _record(sleeper.pid, host="elsewhere", heartbeat=time.time() - STALE_SECONDS - 1)
    store.write_bytes(PIPELINE_LOCK_KEY, record)
    lock = PipelineLock(store, "t1").take()
    assert json.loads(store.read_bytes(PIPELINE_LOCK_KEY))["pid"] == os.getpid()
    lock.release()
    assert not store.exists(PIPELINE_LOCK_KEY)


def test_a_lock_of_another_host_that_still_beats_is_refused(tmp_path, sleeper):
    store = open_store(str(tmp_path))
    store.write_bytes(PIPELINE_LOCK_KEY, _record(12345678, host="elsewhere"))
    with pytest.raises(TrainingInUse, match="on host elsewhere"):
        PipelineLock(store, "t1").take()


def test_a_second_lock_of_the_same_training_is_refused_until_the_first_is_released(tmp_path):
    store = open_store(str(tmp_path))
    with PipelineLock(store, "t1"):
        with pytest.raises(TrainingInUse, match=f"pid {os.getpid()}"):
            PipelineLock(store, "t1").take()
    with PipelineLock(store, "t1"):
        assert store.exists(PIPELINE_LOCK_KEY)
