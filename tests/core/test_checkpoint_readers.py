"""Readers and retention share the store: a checkpoint being read is never deleted under its reader,
whatever a writer with keep_last=1 commits meanwhile (read leases, docs/checkpoint-format.md "Leases")."""

from __future__ import annotations

import threading

import pytest

from relaunch.components.core.checkpoint import CheckpointManager
from relaunch.components.core.checkpoint.readers import READERS, marker_key, readers_dir
from relaunch.components.core.store import open_store
from tests.core.helpers import make_state, s3_root, train_steps
from tests.core.store_hooks import Slow, key_of


@pytest.fixture(params=["fs", "s3"])
def root(request, tmp_path):
    if request.param == "fs":
        return str(tmp_path / "store")
    return s3_root(request.getfixturevalue("s3_env"), "readers")


def _slow_reads(store):
    """A reader on a slow link: each read of a checkpoint's bytes takes 30 ms longer, so that the
    writer commits (and runs retention) while the reader is between choosing and reading."""
    return Slow(store, 0.03, lambda name, args: name in ("read_bytes", "read_into", "sizes")
                and "/step-" in key_of(args))


def test_a_reader_racing_a_writer_with_keep_last_1_is_never_deleted_under(root):
    state = make_state()
    writer = CheckpointManager(root, owner="writer", keep_last=1, async_save=False)
    writer.take_lease()
    writer.save(0, state)
    stop, errors, saved = threading.Event(), [], []

    def write() -> None:
        step = 1
        try:
            while not stop.is_set():
                train_steps(state, 1)
                writer.save(step, state)
                saved.append(step)
                step += 1
        except BaseException as err:  # noqa: BLE001 - asserted below
            errors.append(err)

    thread = threading.Thread(target=write)
    thread.start()
    read = []
    try:
        for _ in range(25):
            with CheckpointManager(_slow_reads(open_store(root)), owner="reader", async_save=False) as reader:
                info = reader.latest()
                assert info is not None
                loaded = reader.load(make_state(), step=info.step)  # evaluate's way: choose, then load
                read.append(loaded.step)
    finally:
        stop.set()
        thread.join()
    assert not errors, errors
    assert len(set(read)) > 1 and len(saved) > len(set(read))  # the writer did move on meanwhile
    last = saved[-1] + 1
    writer.save(last, state)  # every reader is gone: retention keeps only the newest again
    writer.close()
    store = open_store(root)
    assert [i.step for i in CheckpointManager(store).list()] == [last]
    assert store.list(READERS + "/") == []  # every read lease released, no marker left


def test_the_latest_is_never_deleted_under_a_loading_reader(root):
    state = make_state()
    writer = CheckpointManager(root, owner="writer", keep_last=1, async_save=False)
    writer.save(1, state)
    with CheckpointManager(root, owner="reader") as reader:
        chosen = reader.latest()
        writer.save(2, state)  # keep_last=1: step 1 would go
        writer.save(3, state)
        assert reader.load(make_state(), step=chosen.step).step == 1
    writer.save(4, state)  # released: now it goes
    assert [i.step for i in CheckpointManager(root).list()] == [4]
    writer.close()


def test_a_step_marked_for_deletion_by_the_lease_holder_is_passed_over_by_latest(root):
    state = make_state()
    writer = CheckpointManager(root, owner="writer", keep_last=0)
    writer.save(1, state)
    writer.save(2, state)
    writer.wait()
    store = open_store(root)
    # retention's first move on step 2, as the lease holder writes it (it then lists the readers)
    store.write_bytes(marker_key(2), ('{"step": 2, "token": "%s", "expires_at": 9e99}' % writer.lease.token).encode())
    with CheckpointManager(root, owner="reader") as reader:
        assert reader.latest().step == 1
        assert [k.rsplit("/", 1)[-1] != "DELETING.json" for k in store.list(readers_dir(2) + "/")] == [False]
    writer.close()  # a marker whose writer no longer holds the lease is stale: it blocks nobody
    with CheckpointManager(root, owner="reader") as reader:
        assert reader.latest().step == 2


def test_a_step_pinned_under_a_read_lease_is_kept_by_retention(root):
    state = make_state()
    writer = CheckpointManager(root, owner="writer", keep_last=1, async_save=False)
    writer.save(1, state)
    with CheckpointManager(root, owner="register") as registrar:
        registrar.pin(1, "champion")  # under a read lease until the pin is written
    writer.save(2, state)
    writer.save(3, state)
    assert [i.step for i in CheckpointManager(root).list()] == [1, 3]
    writer.close()
