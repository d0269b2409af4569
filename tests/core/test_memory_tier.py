"""The in-memory tier on its own (one process, real sockets, a real torch TCPStore as the registry):
packing a training state without pickling, restoring it bitwise into the memory a state holds or into
a fresh one, the ring replica handed to a peer and fetched back, the memory it holds (4x the shard: two of its own, two of a
peer's, so that a rank lost while handing one over is served at the one before), and a step's
snapshot taken beside the training."""

from __future__ import annotations

import datetime
import json
import random
import socket
import threading
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist

from relaunch.components.core.checkpoint.layout import MANIFEST, step_key
from relaunch.components.core.checkpoint.manager import CheckpointManager
from relaunch.components.core.recovery.memory_tier import MemoryTier, holder_of, newest_common
from relaunch.components.core.recovery.packing import pack, restore_into
from relaunch.components.core.recovery.transport import _HEAD, _LEN
from relaunch.components.core.checkpoint.snapshot import Snapshotter
from relaunch.components.core.store import open_store
from relaunch.components.core.recovery.in_place import CountingStore, StepSnapshots
from tests.core.helpers import assert_bitwise_equal, fingerprint, make_state, train_steps
from tests.core.store_hooks import Partition
from tests.services import free_port


@pytest.fixture
def registry():
    return dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=10))


def committed_snapshot(state):
    """What a save hands the tier: the CPU snapshot of the state it writes."""
    return Snapshotter().take(state)


def test_a_packed_state_restores_bitwise_into_the_memory_the_state_already_holds():
    state = make_state()
    train_steps(state, 3)
    header, payload = pack(committed_snapshot(state))
    expected = fingerprint(make_state_like(state, header, payload))
    train_steps(state, 4)  # the survivor went on past the commit
    params_before = [p.data_ptr() for p in state.model.parameters()]
    moments_before = [v.data_ptr() for s in state.optimizer.state.values() for v in s.values()]
    restore_into(state, header, payload)
    assert [p.data_ptr() for p in state.model.parameters()] == params_before  # no new parameter memory
    assert [v.data_ptr() for s in state.optimizer.state.values() for v in s.values()] == moments_before
    assert_bitwise_equal(fingerprint(state), expected)


def make_state_like(trained, header, payload):
    """A fresh state (a replacement's) restored from the packed snapshot."""
    fresh = make_state(seed=1)
    restore_into(fresh, header, payload)
    return fresh


def test_a_fresh_state_restored_from_a_replica_continues_exactly_as_the_original():
    original = make_state()
    train_steps(original, 3)
    header, payload = pack(committed_snapshot(original))  # the RNG streams of this moment included
    train_steps(original, 2)
    expected = fingerprint(original)
    replacement = make_state_like(original, header, payload)  # the process's streams back to the snapshot's
    train_steps(replacement, 2)
    assert_bitwise_equal(fingerprint(replacement), expected)


def trained_values(state) -> dict:
    """Parameters, optimizer, schedule and progress (not the process-wide RNG streams)."""
    return {k: v for k, v in fingerprint(state).items() if k != "rng"}


def test_an_unknown_object_in_the_state_is_refused_not_pickled():
    with pytest.raises(ValueError, match="cannot hold a object"):
        pack({"model": {"w": torch.zeros(2)}, "odd": object()})


def test_the_holder_keeps_a_peers_replica_and_hands_it_to_the_replacement(registry):
    world = 3
    tiers = [MemoryTier(rank, world, registry) for rank in range(world)]
    try:
        states = [make_state(seed=rank) for rank in range(world)]
        for rank, state in enumerate(states):
            train_steps(state, 2)
            tiers[rank].keep(2, committed_snapshot(state), "sha256:model")
        # rank 1 is replaced: its new tier holds nothing of its own, and asks rank 2 (its holder)
        assert holder_of(1, world) == 2
        tiers[1].close()
        tiers[1] = MemoryTier(1, world, registry)
        held, where = tiers[1].own_or_from_holder()
        assert where == "replica on rank 2" and held[0]["step"] == 2 and held[0]["fingerprint"] == "sha256:model"
        restored = make_state_like(states[1], *held)
        assert_bitwise_equal(trained_values(restored), trained_values(states[1]))
    finally:
        for tier in tiers:
            tier.close()


def test_a_rank_whose_holder_is_gone_too_gets_nothing_from_memory(registry):
    tiers = [MemoryTier(rank, 2, registry) for rank in range(2)]
    state = make_state()
    tiers[0].keep(5, committed_snapshot(state), None)
    tiers[1].close()  # the holder of rank 0's replica is lost
    fresh = MemoryTier(0, 2, registry)
    try:
        assert fresh.own_or_from_holder() == (None, "none")
    finally:
        fresh.close()
        tiers[0].close()


def test_the_tier_holds_its_two_newest_snapshots_and_two_replicas_4x_the_shard_reused_from_snapshot_to_snapshot(registry):
    tiers = [MemoryTier(rank, 2, registry) for rank in range(2)]
    try:
        states = [make_state(seed=rank, width=64) for rank in range(2)]
        shard = len(pack(committed_snapshot(states[0]))[1])
        buffers = []
        for step in (1, 2, 3, 4, 5):
            for rank, state in enumerate(states):
                train_steps(state, 1)
                tiers[rank].keep(step, committed_snapshot(state), None)
            for tier in tiers:
                held = tier.bytes_held()
                kept = min(step, 2)
                assert held == {"own": kept * shard, "replica": kept * shard}, held
                assert [h["step"] for h, _ in tier.kept] == [h["step"] for h, _ in tier.server.replicas] == \
                    list(range(step, step - kept, -1))
            buffers.append({id(p) for tier in tiers for _, p in (*tier.kept, *tier.server.replicas)})
        assert buffers[2] == buffers[3] == buffers[4] == buffers[1]  # packed and received into the same memory
    finally:
        for tier in tiers:
            tier.close()


def test_a_rank_lost_while_handing_its_newest_snapshot_over_is_served_at_the_one_before(registry):
    tiers = [MemoryTier(rank, 2, registry) for rank in range(2)]
    try:
        states = [make_state(seed=rank) for rank in range(2)]
        for step in (1, 2):
            for rank, state in enumerate(states):
                train_steps(state, 1)
                tiers[rank].keep(step, committed_snapshot(state), "fp")
        saved = trained_values(make_state_like(states[1], *tiers[1].own))
        # step 3: rank 0 keeps it; rank 1 is SIGKILLed in the middle of its put to rank 0 (its holder)
        train_steps(states[0], 1)
        tiers[0].keep(3, committed_snapshot(states[0]), "fp")
        header, payload = pack(committed_snapshot(states[1]))
        header.update(step=3, fingerprint="fp")
        raw = json.dumps(header).encode()
        with socket.create_connection(tiers[0].server.address.rsplit(":", 1)) as sock:
            sock.sendall(_HEAD.pack(b"P", 1, -1) + _LEN.pack(len(raw)) + raw + bytes(payload[: len(payload) // 2]))
        tiers[1].close()
        replacement = MemoryTier(1, 2, registry)
        try:
            servable = [tiers[0].servable()[0], replacement.servable()[0]]
            # the holder kept step 2's replica whole (the broken put went into step 1's memory)
            assert servable == [[(3, "fp"), (2, "fp")], [(2, "fp")]], servable
            assert newest_common(servable, "fp") == 2
            held = replacement.take(2)
            assert held[0]["step"] == 2
            assert_bitwise_equal(trained_values(make_state_like(states[1], *held)), saved)
        finally:
            replacement.close()
    finally:
        tiers[0].close()


def _step(state, snapshots) -> None:
    """One step of the training loop's order: forward and backward (a snapshot's copy may still run),
    then the optimizer step once that copy is done."""
    x = torch.randn(8, 4) + float(np.random.rand()) + random.random()
    loss = state.model(x).pow(2).mean()
    state.optimizer.zero_grad()
    loss.backward()
    snapshots.before_optimizer_step()
    state.optimizer.step()
    state.scheduler.step()
    state.step += 1
    state.samples_seen += 8


def test_a_step_snapshot_taken_beside_the_training_is_exactly_that_steps_state(registry):
    tier = MemoryTier(0, 1, registry)
    snapshots = StepSnapshots(tier, every=1)
    original = make_state()
    snapshots.bind(original, "sha256:model")
    train_steps(original, 3)
    assert snapshots.vote(3) == (1.0, 0.0)  # due, not busy
    snapshots.after_step(3)  # the copy runs on its thread while the next steps go on
    for _ in range(2):
        _step(original, snapshots)
    snapshots.halt()
    expected = fingerprint(original)
    header, payload = tier.own
    assert header["step"] == 3 and header["taken_at"] is not None
    replacement = make_state(seed=1)
    restore_into(replacement, header, payload)
    for _ in range(2):
        train_steps(replacement, 1)
    assert_bitwise_equal(fingerprint(replacement), expected)
    snapshots.close()
    tier.close()


def test_the_tier_keeps_the_newer_of_a_step_snapshot_and_a_later_commits_older_one(registry):
    tier = MemoryTier(0, 1, registry)
    state = make_state()
    train_steps(state, 2)
    older = committed_snapshot(state)
    train_steps(state, 3)
    tier.keep(5, committed_snapshot(state), None)
    tier.keep(2, older, None)  # the save of step 2 hands its copy over after the snapshot of step 5
    assert tier.own[0]["step"] == 5
    tier.drop_own()  # the training went back to the store's step 2
    tier.keep(2, older, None)
    assert tier.own[0]["step"] == 2
    tier.close()


def test_across_nodes_each_rank_replicates_to_the_same_local_rank_on_the_next_node():
    # 3 nodes of 2 ranks: a node lost whole keeps both its ranks' replicas on the next node
    assert [holder_of(r, 6, per_node=2) for r in range(6)] == [2, 3, 4, 5, 0, 1]
    # one node (or no node count): the next rank on the ring
    assert [holder_of(r, 4, per_node=4) for r in range(4)] == [1, 2, 3, 0]
    assert [holder_of(r, 3) for r in range(3)] == [1, 2, 0]


def test_the_bytes_a_restore_reads_from_the_store_count_checkpoints_not_the_trackers_attempt_records(tmp_path):
    raw = open_store(str(tmp_path / "store"))
    raw.write_bytes(f"{step_key(20)}/shard-0", b"s" * 300)
    raw.write_bytes("runs/attempts/attempt-0001.json", b"{}" * 350)  # what the MLflow logger's thread reads
    store = CountingStore(raw)
    store.read_bytes("runs/attempts/attempt-0001.json")
    assert store.bytes_read == 0
    store.read_bytes(f"{step_key(20)}/shard-0")
    store.read_into(f"{step_key(20)}/shard-0", 100, bytearray(200))
    assert store.bytes_read == 500


def held_at_the_commit_point(tmp_path):
    """A file store that holds the commit point (a manifest's write) until ``heal()``."""
    return Partition(open_store(str(tmp_path / "store")),
                     lambda name, args: name == "write_bytes" and str(args[0]).endswith(MANIFEST))


def save_step_2(store, on_snapshot):
    """The manager saving a trained state as step 2 to ``store``, ``on_snapshot`` its callback, and the
    state's fingerprint as saved (its RNG streams drawn from where the save took them)."""
    state = make_state()
    train_steps(state, 2)
    manager = CheckpointManager(store, keep_last=2, owner="tier-test")
    manager.on_snapshot(on_snapshot)
    manager.save(2, state)
    return fingerprint(state), manager


def test_a_saves_copy_reaches_the_tier_before_the_store_commits_it(tmp_path, registry):
    # a slow upload must not leave the tier on an older state: a rank lost during it would then be
    # served a step its peers no longer hold, and every rank would read the store
    tier = MemoryTier(0, 1, registry)
    handed = threading.Event()

    def keep(step, snapshot):
        tier.keep(step, snapshot, None)
        handed.set()

    store = held_at_the_commit_point(tmp_path)
    saved, manager = save_step_2(store, keep)
    try:
        assert store.cut.wait(30), "the save never reached its commit point"
        assert handed.wait(30), "the tier got the save's copy only after its commit"
        assert tier.own[0]["step"] == 2
        assert_bitwise_equal(fingerprint(make_state_like(None, *tier.own)), saved)
        store.heal()
        manager.wait()
        assert manager.latest().step == 2
    finally:
        store.heal()
        manager.close()
        tier.close()


def test_a_commit_does_not_wait_for_the_tiers_hand_over(tmp_path):
    # the hand-over to a peer may be slow (its holder gone, a busy link): the checkpoint commits anyway
    store = open_store(str(tmp_path / "store"))
    seen_committed = []

    def slow_hand_over(step, snapshot):
        deadline = time.monotonic() + 30
        while not store.exists(f"{step_key(step)}/{MANIFEST}") and time.monotonic() < deadline:
            time.sleep(0.01)
        seen_committed.append(store.exists(f"{step_key(step)}/{MANIFEST}"))

    _, manager = save_step_2(store, slow_hand_over)
    manager.close()
    assert seen_committed == [True]
