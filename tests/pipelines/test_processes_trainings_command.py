"""``relaunch trainings``: each training of a store with its state, read from the store's records alone —
running (a live process holds its lease), interrupted at step N, failed, trained but not evaluated or
registered, finished, nothing trained yet — also when the store is mounted read-only."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from dataclasses import asdict

import pytest

from relaunch.components.core.checkpoint.layout import LATEST, LEASE
from relaunch.components.core.store import open_store
from relaunch.components.core.store import records
from relaunch.components.core.store.training_folders import training_uri
from relaunch.components.core.store.ledger import Attempt
from tests.cli import RELAUNCH

TOTAL = 60


def _training(root: str, name: str, *, attempt: dict | None = None, summary: dict | None = None,
              committed: int | None = None, finished: bool = False):
    store = open_store(training_uri(root, name))
    records.write_training_config(store, {"train": {"max_steps": TOTAL}})
    records.remember_run(store, f"run-{name}", tracking_uri="sqlite:///nowhere.db", experiment="relaunch")
    if attempt is not None:
        records.write_json(store, records.attempt_key(1), asdict(Attempt(attempt=1, start=time.time(), **attempt)))
    if summary is not None:
        records.write_summary(store, {"run_id": f"run-{name}", "attempt": 1, "total_steps": TOTAL, **summary})
    if committed is not None:
        store.write_bytes(LATEST, json.dumps({"step": committed, "path": f"checkpoints/step-{committed:012d}"}).encode())
    if finished:
        records.write_pipeline_finished(store, f"run-{name}", "pipeline-1")
    return store


@pytest.fixture
def store_root(tmp_path):
    """A store root with one training in each state; the live lease holder is a real process."""
    root = str(tmp_path / "store")
    _training(root, "20260101-000001")
    holder = subprocess.Popen(["sleep", "300"])
    running = _training(root, "20260101-000002", attempt={"last_step": 5}, committed=5)
    running.write_bytes(LEASE, json.dumps({
        "owner": "run:x", "token": "t", "host": socket.gethostname(), "pid": holder.pid,
        "pid_namespace": str(os.stat("/proc/self/ns/pid").st_ino), "expires_at": time.time() + 300}).encode())
    _training(root, "20260101-000003", attempt={"last_step": 17, "last_committed_step": 15, "exit_code": 143},
              summary={"exit_code": 143, "last_step": 17, "last_committed_step": 15,
                       "reason": "preempted by SIGTERM at step 17"}, committed=15)
    _training(root, "20260101-000004", attempt={"last_step": 0, "exit_code": 2},
              summary={"exit_code": 2, "last_step": 0, "reason": "train.lr: must be positive"})
    _training(root, "20260101-000005", attempt={"last_step": TOTAL, "last_committed_step": TOTAL, "exit_code": 0},
              summary={"exit_code": 0, "last_step": TOTAL, "last_committed_step": TOTAL, "reason": "finished"},
              committed=TOTAL)
    _training(root, "20260101-000006", attempt={"last_step": TOTAL, "last_committed_step": TOTAL, "exit_code": 0},
              summary={"exit_code": 0, "last_step": TOTAL, "last_committed_step": TOTAL, "reason": "finished"},
              committed=TOTAL, finished=True)
    _killed_between_manifest_and_pointer(root, "20260101-000007")
    try:
        yield root
    finally:
        holder.kill()
        holder.wait()


def _killed_between_manifest_and_pointer(root: str, name: str) -> None:
    """Two real commits (steps 5 and 10), then latest.json put back to step 5: where a kill between step
    10's manifest and the pointer's advance leaves the store. A resume starts from step 10."""
    import torch

    from relaunch.components.core.checkpoint import CheckpointManager

    store = _training(root, name, attempt={"last_step": 11, "last_committed_step": 5, "exit_code": 137})
    with CheckpointManager(store, async_save=False) as manager:
        manager.save(5, {"w": torch.zeros(4)})
        pointer_at_5 = store.read_bytes(LATEST)
        manager.save(10, {"w": torch.ones(4)})
        assert manager.latest().step == 10
    store.write_bytes(LATEST, pointer_at_5)


EXPECTED = {"20260101-000001": ("prepared", -1), "20260101-000002": ("running", 5),
            "20260101-000003": ("interrupted", 15), "20260101-000004": ("failed", -1),
            "20260101-000005": ("trained", TOTAL), "20260101-000006": ("finished", TOTAL),
            "20260101-000007": ("interrupted", 10)}


def _listed(command: list[str]) -> dict[str, dict]:
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return {t["name"]: t for t in json.loads(done.stdout)}


def test_each_training_is_listed_with_its_state_and_step(store_root):
    listed = _listed([RELAUNCH, "trainings", "--store", store_root, "--json", "--no-registry"])
    assert {name: (t["state"], t["step"]) for name, t in listed.items()} == EXPECTED
    assert f"pid " in listed["20260101-000002"]["detail"] and socket.gethostname() in listed["20260101-000002"]["detail"]
    assert "at step 17" in listed["20260101-000003"]["detail"] and "resumes from step 15" in listed["20260101-000003"]["detail"]
    assert "relaunch run --resume" in listed["20260101-000005"]["detail"]
    assert "resumes from step 10" in listed["20260101-000007"]["detail"]
    table = subprocess.run([RELAUNCH, "trainings", "--store", store_root, "--no-registry"], capture_output=True,
                           text=True, timeout=120)
    assert table.returncode == 0 and table.stdout.splitlines()[0].split()[:3] == ["TRAINING", "STATE", "STEP"]
    assert len(table.stdout.splitlines()) == 1 + len(EXPECTED)


def test_a_read_only_store_is_listed_the_same(store_root, tmp_path):
    """The store mounted read-only (a bind mount remounted ro in a private mount namespace)."""
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-m", "--propagation", "private", "true"],
                                                         capture_output=True).returncode != 0:
        if os.environ.get("CI"):
            pytest.fail("CI must be able to make a private mount namespace (unshare -m)")
        pytest.skip("no private mount namespace here (unshare -m needs root or user namespaces)")
    script = (f"mount --bind {store_root} {store_root} && mount -o remount,ro,bind {store_root} && "
              f"touch {store_root}/probe 2>/dev/null && exit 9; "
              f"exec {RELAUNCH} trainings --store {store_root} --json --no-registry")
    listed = _listed(["unshare", "-m", "--propagation", "private", "sh", "-c", script])
    assert {name: (t["state"], t["step"]) for name, t in listed.items()} == EXPECTED
