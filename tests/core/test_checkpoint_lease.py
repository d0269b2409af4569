"""Two writers on one root (a pipeline started twice, an orphan beside a ``--resume``): the second is
refused (or waits) while the first holds the lease, the heartbeat keeps it held between saves, a
writer that lost it is fenced, and the histories never interleave."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from relaunch.components.core.checkpoint import LEASE, CheckpointManager
from relaunch.components.core.checkpoint.layout import read_json
from relaunch.components.core.checkpoint.write_lease import LeaseLost
from relaunch.components.core.contract.errors import BadInput
from relaunch.components.core.store import open_store
from tests.core.helpers import make_state, s3_root, train_steps
from tests.core.store_hooks import Partition, key_of

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(params=["fs", "s3"])
def root(request, tmp_path):
    if request.param == "fs":
        return str(tmp_path / "store")
    return s3_root(request.getfixturevalue("s3_env"), "lease")


def _wait_until_expired(store) -> None:
    while float((read_json(store, LEASE) or {}).get("expires_at", 0)) >= time.time():
        time.sleep(0.05)


def _files(store, step: int) -> list[str]:
    return store.list(f"checkpoints/step-{step:012d}/")


def test_a_second_writer_is_refused_while_the_first_holds_the_lease(root):
    first = CheckpointManager(root, owner="run-a", lease_seconds=60)
    second = CheckpointManager(root, owner="run-b", lease_seconds=60)
    state = make_state()
    first.save(1, state)
    first.wait()
    with pytest.raises(BadInput, match=r"being written by 'run-a'.*refusing a second writer"):
        second.save(2, state)
    train_steps(state, 1)
    first.save(3, state)
    assert first.wait().step == 3
    history = [i.step for i in CheckpointManager(root).list()]
    assert history == [1, 3]  # nothing of run-b's in between
    assert json.loads(open_store(root).read_bytes("checkpoints/latest.json"))["step"] == 3
    first.close()
    second.close()


def test_the_heartbeat_keeps_the_lease_held_past_lease_seconds_between_saves(root):
    store = open_store(root)
    first = CheckpointManager(root, owner="run-a", lease_seconds=1.5)  # renewed every 0.5 s: slack for a busy moto
    first.take_lease()
    taken = read_json(store, LEASE)
    state = make_state()
    first.save(1, state)
    first.wait()
    while time.time() < taken["expires_at"] + 3 * 1.5:  # several lease times without a save
        time.sleep(0.1)
    second = CheckpointManager(root, owner="run-b", lease_seconds=60)
    with pytest.raises(BadInput, match="refusing a second writer"):
        second.take_lease()
    first.save(2, state)
    assert first.wait().step == 2
    first.close()
    second.close()


def test_a_live_writer_of_the_same_owner_makes_the_second_wait_then_refuses_it(root):
    orphan = subprocess.Popen(  # the first process of this training, still running and renewing
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys
            from relaunch.components.core.checkpoint import CheckpointManager
            mgr = CheckpointManager({root!r}, owner="run-a", lease_seconds=1.5)
            mgr.take_lease()
            print("held", flush=True)
            sys.stdin.read()
        """)], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True)
    try:
        assert orphan.stdout.readline().strip() == "held"
        resumed = CheckpointManager(root, owner="run-a", lease_seconds=1.5, lease_wait_seconds=3)  # --resume
        with pytest.raises(BadInput, match="being written by 'run-a'"):
            resumed.take_lease()
    finally:
        orphan.kill()
        orphan.wait(30)
    resumed.take_lease()  # its process is gone: taken at once
    resumed.close()
    assert not open_store(root).exists(LEASE)


def test_a_second_manager_of_the_same_training_in_one_process_takes_over_and_fences_the_first(root):
    state = make_state()
    first = CheckpointManager(root, owner="run-a", lease_seconds=300)
    first.save(1, state)
    first.wait()
    second = CheckpointManager(root, owner="run-a", lease_seconds=300, lease_wait_seconds=0)
    second.save(2, state)
    assert second.wait().step == 2
    first.save(3, state)
    with pytest.raises(LeaseLost):
        first.wait()
    assert [i.step for i in second.list()] == [1, 2]
    second.close()
    first.close()


def test_a_later_torchelastic_attempt_takes_the_lease_over_at_once_and_fences_the_old_one(root, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-1")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    old = CheckpointManager(root, owner="run-a", lease_seconds=300)
    state = make_state()
    old.save(1, state)
    old.wait()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    new = CheckpointManager(root, owner="run-a", lease_seconds=300, lease_wait_seconds=0)
    new.take_lease()  # no wait: torchelastic stopped the previous attempt's workers first
    old.save(2, state)
    with pytest.raises(LeaseLost, match="lost the write lease"):
        old.wait()
    new.save(3, state)
    assert new.wait().step == 3
    assert [i.step for i in new.list()] == [1, 3]
    new.close()
    old.close()


def test_a_writer_whose_process_died_on_this_host_is_taken_over_at_once(root, tmp_path):
    script = textwrap.dedent(f"""
        import os, signal
        from relaunch.components.core.checkpoint import CheckpointManager
        from tests.core.helpers import make_state
        mgr = CheckpointManager({root!r}, owner="run-a", lease_seconds=300)
        mgr.save(1, make_state())
        mgr.wait()
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    store = open_store(root)
    assert read_json(store, LEASE)["expires_at"] > time.time() + 60  # killed: its lease is still live
    restarted = CheckpointManager(root, owner="run-a", lease_seconds=300, lease_wait_seconds=0)
    restarted.take_lease()
    restarted.save(2, make_state())
    assert restarted.wait().step == 2
    restarted.close()
    assert not store.exists(LEASE)


def _take_over_with_step_3_in_flight(store, state):
    """Once the old writer's lease expired, a second run takes it and saves step 3, held just before its
    commit (files written, no manifest); returns that manager, its link and the in-flight files."""
    _wait_until_expired(store)
    new_link = Partition(store, lambda name, args: name == "write_bytes"
                         and key_of(args).endswith("step-000000000003/MANIFEST.json"))
    new = CheckpointManager(new_link, owner="run-b", lease_seconds=60, keep_last=1)
    new.take_lease()
    new.save(3, state)
    assert new_link.cut.wait(60)
    in_flight = _files(store, 3)
    assert in_flight
    return new, new_link, in_flight


def test_a_stalled_writer_taken_over_commits_nothing_and_spares_the_new_holders_save(root):
    store = open_store(root)
    state = make_state()
    # the old writer's link to the store goes down while it writes step 2 (its heartbeat stalls too)
    old_link = Partition(store, lambda name, args: name == "open_writer" and "step-000000000002" in key_of(args))
    old = CheckpointManager(old_link, owner="run-a", lease_seconds=1, keep_last=1)
    old.save(1, state)
    old.wait()
    old.save(2, state)
    assert old_link.cut.wait(60)
    new, new_link, in_flight = _take_over_with_step_3_in_flight(store, state)
    old_link.heal()
    with pytest.raises(LeaseLost, match="lost the write lease"):
        old.wait()
    assert not store.exists("checkpoints/step-000000000002/MANIFEST.json")  # fenced before its commit
    assert _files(store, 3) == in_flight and _files(store, 1)  # nothing deleted
    new_link.heal()
    assert new.wait().step == 3
    assert [i.step for i in new.list()] == [3]
    new.close()
    old.close()
    assert not store.exists(LEASE)


def test_a_writer_taken_over_between_its_commit_and_retention_deletes_nothing(root):
    store = open_store(root)
    state = make_state()
    committed = []

    def at_retention(name: str, args: tuple) -> bool:
        if name == "write_bytes" and key_of(args).endswith("step-000000000002/MANIFEST.json"):
            committed.append(2)
        return bool(committed) and name == "list" and key_of(args) == "checkpoints/"

    old_link = Partition(store, at_retention)
    old = CheckpointManager(old_link, owner="run-a", lease_seconds=1, keep_last=1)
    old.save(1, state)
    old.wait()
    old.save(2, state)
    assert old_link.cut.wait(60)
    new, new_link, in_flight = _take_over_with_step_3_in_flight(store, state)
    old_link.heal()
    with pytest.raises(LeaseLost):
        old.wait()
    assert _files(store, 3) == in_flight  # the new holder's in-flight save survived
    assert store.exists("checkpoints/step-000000000001/MANIFEST.json")  # and nothing else was deleted
    new_link.heal()
    assert new.wait().step == 3
    new.close()
    old.close()


def test_readers_never_take_the_write_lease(root):
    writer = CheckpointManager(root, owner="run-a")
    state = make_state()
    writer.save(1, state)
    writer.wait()
    reader = CheckpointManager(root, owner="someone-else")
    assert reader.latest().step == 1
    reader.load(make_state())
    reader.close()
    assert json.loads(open_store(root).read_bytes(LEASE))["owner"] == "run-a"
    writer.close()


def test_a_second_training_is_refused_before_it_trains(tmp_path):
    from relaunch.components.core.checkpoint import checkpoint_steps

    store_uri = str(tmp_path / "store")
    holder = CheckpointManager(store_uri, owner="run-a", lease_seconds=60)  # the first training, alive
    holder.take_lease()
    config = {"store": {"uri": store_uri}, "train": {"max_steps": 4, "checkpoint_every_steps": 2}}
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_TRACKING_URI")}
    result = subprocess.run([sys.executable, "-m", "relaunch.components.train", "--config-json", json.dumps(config)],
                            cwd=tmp_path, env={**env, "PYTHONPATH": str(ROOT), "RELAUNCH_OWNER": "run-b"},
                            capture_output=True, text=True, timeout=300)
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert result.returncode == 2, result.stderr[-3000:]
    assert len(errors) == 1 and "being written by 'run-a'" in errors[0], result.stderr[-3000:]
    assert "RELAUNCH_RESUMED" not in result.stdout and "RELAUNCH_PROGRESS" not in result.stdout
    assert checkpoint_steps(open_store(store_uri)) == []
    holder.close()
