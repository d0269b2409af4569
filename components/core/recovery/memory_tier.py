"""The in-memory tier of the checkpoints: each rank's newest snapshot in host memory, and a
replica of one peer's, so that a killed worker's replacement and its survivors restore without the store.

    tier = MemoryTier(rank, world_size, registry)      # registry: a key-value store every rank reaches
    tier.keep(step, snapshot, fingerprint)             # a step's snapshot (a thread beside the training), or a
                                                       # save's copy (beside the store's writes)
    steps, where = tier.servable()                     # at a (re)start: the steps this rank can be served at
    held = tier.take(step)                             # the one the ranks agreed on (a replacement fetches it)
    restore_into(state, *held)                         # copied into the memory the state already holds

Ring replication: rank ``r`` holds the replica of rank ``(r - 1) mod W``'s shard, so its holder is
``(r + 1) mod W``; across nodes of ``P`` ranks each, ``(r + P) mod W``, the next node's (:func:`holder_of`).
A rank and its holder lost together leave the tier unable to serve that rank: the store is read then.
The replica goes over plain TCP, to a small server thread of each rank (:class:`ReplicaServer`) whose
address is published in the job's rendezvous store: the transfer does not depend on the process group,
which is broken exactly when a replica is needed.

Memory, per rank, bounded: its own two newest snapshots and the two newest replicas of one peer, each
one packed payload (the tensor bytes of its shard of model, optimizer, RNG and counters; no pickling: a
JSON tree of plain values plus raw tensor bytes), the older one's memory taking the next when its size is
unchanged: 4x the shard. Two of each, because a rank lost in the middle of handing its newest snapshot
over (SIGKILL does not wait) leaves its holder with the replica before that, and the survivors, whose own
newest is already the next step, then serve the step before it, which every rank still holds; with one
of each (2x), the store served then.
Snapshots are of whole steps: every few steps (``train.memory_snapshot_every_steps``, taken beside the
training by :class:`relaunch.components.core.recovery.in_place.StepSnapshots`) and each checkpoint
save's copy, kept while the store is still written (with that 0, only those). Each is tagged with its
step and the checkpoint's model fingerprint, and the ranks agree on the newest step that every rank holds
before any of them restores (:func:`newest_common`); only when none is held by all (a rank lost with its
holder) the store serves.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import numpy as np

from .packing import pack
from .transport import KEPT, ReplicaServer, get_replica, list_replicas, put_replica


def newest_common(tags: list[list[tuple[int, str | None]]], fingerprint: str | None) -> int:
    """The newest step that every rank can be served at (``tags``: each rank's servable (step,
    fingerprint) pairs, :meth:`MemoryTier.servable`) with the model's ``fingerprint``, or -1."""
    common: set[int] | None = None
    for held in tags:
        steps = {int(step) for step, fp in held if fp == fingerprint and int(step) >= 0}
        common = steps if common is None else common & steps
    return max(common) if common else -1


def holder_of(rank: int, world_size: int, per_node: int | None = None) -> int:
    """The rank that holds ``rank``'s replica: the next one on the ring; with ranks on several nodes
    (``per_node`` of them on each, node by node), the same local rank on the next node, so that a node
    lost whole leaves every one of its ranks' replicas on a node that lives."""
    stride = per_node if per_node and world_size > per_node else 1
    return (rank + stride) % world_size


def registry_key(rank: int) -> str:
    return f"relaunch/memory-tier/rank{rank}"





class MemoryTier:
    """One rank's side of the tier: its own ``KEPT`` newest snapshots, its server holding a peer's
    replicas, and the registry where every rank finds the others' servers.

    Args:
        rank, world_size: this rank in the job.
        host: the address of this rank's node that the other ranks reach (its replica server listens there).
        per_node: ranks per node (:func:`holder_of`: a replica goes to the next node).
        registry: the job's key-value store (``set(key, bytes)``, ``check([key])``, ``get(key)``: a
            ``torch.distributed.Store``); ranks publish their server's address there.
    """

    def __init__(self, rank: int, world_size: int, registry: Any, host: str = "127.0.0.1", per_node: int | None = None):
        self.rank, self.world_size, self.registry = rank, world_size, registry
        self.holder = holder_of(rank, world_size, per_node)
        self.server = ReplicaServer(host)
        self.kept: list[tuple[dict, np.ndarray]] = []  # its own snapshots, newest first
        self.lock = threading.Lock()  # guards kept
        self.turn = threading.Lock()  # one keep at a time
        self.holder_address: str | None = None
        registry.set(registry_key(rank), self.server.address)

    @property
    def own(self) -> tuple[dict, np.ndarray] | None:
        """This rank's newest snapshot kept."""
        with self.lock:
            return self.kept[0] if self.kept else None

    def _address(self, rank: int) -> str | None:
        key = registry_key(rank)
        if not self.registry.check([key]):
            return None
        return self.registry.get(key).decode()

    def keep(self, step: int, snapshot: Any, fingerprint: str | None, *, taken_at: float | None = None,
             copied: Callable[[], None] | None = None) -> None:
        """Keep ``snapshot``, the state of ``step``, as this rank's own (packed into the memory of the
        oldest one kept, the newest kept whole) and hand it to this rank's holder, unless the one kept
        is as new. ``copied`` is
        called once the snapshot's tensors are copied (a snapshot of the live state: the training may
        change them after that). ``taken_at``: when the step was done (the goodput's recomputed time).
        Callers on two threads (commits, the step snapshots) take turns."""
        with self.turn:
            with self.lock:
                if self.kept and self.kept[0][0]["step"] >= step:  # a newer one is kept already
                    if copied is not None:
                        copied()
                    return
                spare = self.kept.pop() if len(self.kept) >= KEPT else None
            try:
                header, payload = pack(snapshot, spare[1] if spare is not None else None)
            finally:
                if copied is not None:
                    copied()
            header.update(step=int(step), fingerprint=fingerprint, rank=self.rank, world_size=self.world_size,
                          taken_at=taken_at)
            with self.lock:
                self.kept.insert(0, (header, payload))
            if self.world_size > 1:
                self._push(header, payload)

    def _push(self, header: dict, payload: np.ndarray) -> None:
        """To the holder whose address the registry gave last (asked again after a failed transfer: a
        replacement holder publishes a new one)."""
        holder = self.holder
        for fresh in (False, True):
            if fresh or self.holder_address is None:
                self.holder_address = self._address(holder)
            if self.holder_address is None:
                return
            try:
                put_replica(self.holder_address, self.rank, header, payload)
                return
            except OSError:
                if fresh:
                    raise

    def forget_holder(self) -> None:
        """The group changed (a recovery): ask the registry for the holder's address again."""
        self.holder_address = None

    def drop_own(self) -> None:
        """The training went back to an older step (a restore from the store): what is kept is not its past."""
        with self.turn, self.lock:
            self.kept = []

    def forget_after(self, step: int) -> None:
        """The training went back to ``step`` (a restore from the older of two snapshots): what is kept
        of later steps is not its past any more (a later keep of those steps would be skipped)."""
        with self.turn, self.lock:
            self.kept = [held for held in self.kept if held[0]["step"] <= step]

    def adopt(self, header: dict, payload: np.ndarray) -> None:
        """Take a replica fetched from the holder as this rank's own snapshot (a replacement's)."""
        with self.lock:
            self.kept = [(header, payload)]

    def servable(self) -> tuple[list[tuple[int, str | None]], str]:
        """The (step, fingerprint) of each snapshot this rank can be restored at, newest first, and where
        they are: its own (a survivor), else the replicas its holder keeps (a replacement: listed, not
        fetched; :meth:`take` fetches the one agreed on), else none."""
        with self.lock:
            kept = list(self.kept)
        if kept:
            return [(int(h["step"]), h.get("fingerprint")) for h, _ in kept], "own"
        address = self._holder_address()
        if address is None:
            return [], "none"
        try:
            return list_replicas(address, self.rank), f"replica on rank {self.holder}"
        except OSError:  # the holder is gone too: the store serves
            return [], "none"

    def take(self, step: int) -> tuple[dict, np.ndarray] | None:
        """This rank's snapshot of ``step``: its own, else fetched from its holder (and adopted as its
        own); None when neither has it any more (the holder lost since :meth:`servable`)."""
        with self.lock:
            for held in self.kept:
                if held[0]["step"] == step:
                    return held
        address = self._holder_address()
        if address is None:
            return None
        try:
            fetched = get_replica(address, self.rank, step)
        except OSError:
            return None
        if fetched is not None:
            self.adopt(*fetched)
        return fetched

    def _holder_address(self) -> str | None:
        """The holder's server (a replacement asks it), or None: a world of one, or none published."""
        if self.world_size == 1:
            return None
        address = self._address(self.holder)
        return None if address is None or address == self.server.address else address

    def own_or_from_holder(self) -> tuple[tuple[dict, np.ndarray] | None, str]:
        """This rank's newest snapshot: its own when it has one (a survivor), else the replica its
        holder keeps (a replacement), else None; and where it came from."""
        own = self.own
        if own is not None:
            return own, "own"
        holder = self.holder
        address = self._holder_address()
        if address is None:
            return None, "none"
        try:
            fetched = get_replica(address, self.rank)
        except OSError:  # the holder is gone too: the store serves
            return None, "none"
        if fetched is None:
            return None, "none"
        self.adopt(*fetched)
        return fetched, f"replica on rank {holder}"

    def bytes_held(self) -> dict[str, int]:
        """Host memory the tier holds now: this rank's own snapshots and the peer replicas it keeps."""
        with self.lock:
            own = sum(len(p) for _, p in self.kept)
        with self.server.lock:
            replica = sum(len(p) for _, p in self.server.replicas)
        return {"own": own, "replica": replica}

    def close(self) -> None:
        self.server.close()
