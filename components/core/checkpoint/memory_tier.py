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
training by :class:`relaunch.components.core.trainer.recovery_in_place.StepSnapshots`) and each checkpoint
save's copy, kept while the store is still written (with that 0, only those). Each is tagged with its
step and the checkpoint's model fingerprint, and the ranks agree on the newest step that every rank holds
before any of them restores (:func:`newest_common`); only when none is held by all (a rank lost with its
holder) the store serves.
"""

from __future__ import annotations

import contextlib
import json
import math
import socket
import struct
import sys
import threading
from typing import Any, Callable

import numpy as np
import torch

from .prefault import populate
from .snapshot import local_part

ALIGN = 64  # every tensor's bytes start at a multiple of this in the payload
_HEAD = struct.Struct("!cIq")  # op ('P' put, 'G' get, 'L' list), owner rank, step ('G': -1 the newest)
_LEN = struct.Struct("!Q")
SOCKET_TIMEOUT_SECONDS = 30.0
KEPT = 2  # snapshots of each kind a rank holds (its own, its peer's replicas): the newest and the one before


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


# ------------------------------------------------------------------------------------ packing


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"memory tier: unknown tensor dtype {name!r}")
    return dtype


def _tree(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """``obj`` as JSON-able values, each tensor (its local part) replaced by its index in ``tensors``."""
    if isinstance(obj, torch.Tensor):
        local = local_part(obj).detach()
        if local.device.type != "cpu":
            local = local.cpu()
        tensors.append(local.contiguous())
        return {"x": len(tensors) - 1, "dtype": str(local.dtype), "shape": list(local.shape)}
    if isinstance(obj, dict):
        return {"d": [[_tree(k, tensors), _tree(v, tensors)] for k, v in obj.items()]}
    if isinstance(obj, list):
        return {"l": [_tree(v, tensors) for v in obj]}
    if isinstance(obj, tuple):
        return {"t": [_tree(v, tensors) for v in obj]}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise ValueError(f"memory tier: cannot hold a {type(obj).__name__} of the training state")


def new_payload(size: int) -> np.ndarray:
    """``size`` bytes of new memory for a packed state, its pages made present before the bytes arrive
    (faster than faulting each page inside the receive's copy): on the main thread (a replacement
    fetching its replica) by torch's threaded fill, about twice as fast here as ``bytearray(size)``'s
    single memset; on another thread (the replica server taking a peer's put, the snapshot thread) by
    the kernel (``madvise(MADV_POPULATE_WRITE)``, 103 ms against 81 ms for 384 MiB), because a threaded
    fill from a second thread left the main thread's later copies ~20 % slower for the rest of the
    process (a survivor's restore: 40 ms instead of 33 ms for 384 MiB at two intra-op threads; cause not
    found, reproduced only with the tier's transfer)."""
    if threading.current_thread() is threading.main_thread():
        return torch.zeros(size, dtype=torch.uint8).numpy()
    payload = np.zeros(size, dtype=np.uint8)  # calloc: a large one is fresh pages, none present yet
    populate([torch.from_numpy(payload)])
    return payload


def pack(snapshot: Any, into: np.ndarray | None = None) -> tuple[dict, np.ndarray]:
    """The tree of ``snapshot`` (JSON-able) and its tensors' bytes, written into ``into`` when it has
    the very size needed (no new allocation), else into a new buffer."""
    tensors: list[torch.Tensor] = []
    tree = _tree(snapshot, tensors)
    offsets, size = [], 0
    for t in tensors:
        offsets.append(size)
        size += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    payload = into if into is not None and len(into) == size else new_payload(size)
    view = np.frombuffer(payload, dtype=np.uint8) if size else None
    for t, at in zip(tensors, offsets):
        n = t.numel() * t.element_size()
        if n:
            view[at:at + n] = t.reshape(-1).view(torch.uint8).numpy()
    return {"tree": tree, "offsets": offsets, "bytes": size}, payload


def restore_into(state: Any, header: dict, payload: np.ndarray | bytearray | memoryview,
                 live: dict[str, Any] | None = None) -> None:
    """A packed snapshot back into ``state`` (a ``TrainingState``): each tensor's bytes copied from
    ``payload`` straight into the tensor the live state holds at its place (no allocation, no page
    fault, no intermediate view tree), the rest loaded. ``live``: the state's
    :meth:`~TrainingState.live_tensors` when the caller holds them already (a survivor's snapshots
    found them once), else they are asked for. When every model and optimizer tensor found its live
    tensor, the load is told so (``in_place``) and skips handing them back through DCP's
    ``set_state_dict``."""
    template = live if live is not None else state.live_tensors()
    tree = header["tree"]
    if not isinstance(tree, dict) or "d" not in tree:
        raise ValueError("memory tier: a malformed packed state")
    into = _Into(header, payload)
    filled: dict[str, Any] = {}
    with torch.no_grad():
        for key, node in tree["d"]:
            into.watched = key in ("model", "optimizer")
            filled[key] = into.fill(template.get(key), node)
    state.load_state_dict(filled, in_place=not into.cloned)


class _Into:
    """One pass over a packed tree (:func:`pack`): each tensor's bytes into the tensor at the same
    place of a template (a ``state_dict()`` shape of the live state: the memory it already holds,
    DTensors keeping their layout), or, where the template has none, into a clone; plain values
    as they are."""

    def __init__(self, header: dict, payload: np.ndarray | bytearray | memoryview):
        self.offsets = header["offsets"]
        self.whole = torch.frombuffer(payload, dtype=torch.uint8) if header["bytes"] else None  # one export, sliced
        self.watched = False  # filling the model or the optimizer: a clone there means not all in place
        self.cloned = False

    def tensor(self, node: dict) -> torch.Tensor:
        """The packed tensor of ``node``, a view of the payload."""
        dtype, shape = _dtype(node["dtype"]), node["shape"]
        count = math.prod(shape)
        if count == 0:
            return torch.empty(shape, dtype=dtype)
        at = self.offsets[node["x"]]
        return self.whole[at:at + count * dtype.itemsize].view(dtype).view(shape)

    def fill(self, template: Any, node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        if "x" in node:
            if isinstance(template, torch.Tensor):
                local = local_part(template)
                if list(local.shape) != node["shape"] or str(local.dtype) != node["dtype"]:
                    raise ValueError(f"memory tier: a tensor of shape {tuple(node['shape'])} {node['dtype']} does "
                                     f"not fit {tuple(local.shape)} {local.dtype}")
                if local.numel():
                    local.copy_(self.tensor(node))  # in its own dtype: a uint8 copy is ~10% slower here
                return template
            self.cloned = self.cloned or self.watched
            return self.tensor(node).clone()
        if "d" in node:
            inner = template if isinstance(template, dict) else {}
            out = {}
            for k, v in node["d"]:
                key = self.fill(None, k)
                out[key] = self.fill(inner.get(key), v)
            return out
        if "l" in node or "t" in node:
            values = node.get("l", node.get("t"))
            inner = template if isinstance(template, (list, tuple)) and len(template) == len(values) else [None] * len(values)
            items = [self.fill(t, v) for t, v in zip(inner, values)]
            return items if "l" in node else tuple(items)
        raise ValueError("memory tier: a malformed packed state")


# ------------------------------------------------------------------------------------ transport


def _recv_exact(sock: socket.socket, n: int, into: memoryview | None = None) -> memoryview:
    buf = into if into is not None else memoryview(bytearray(n))
    got = 0
    while got < n:
        k = sock.recv_into(buf[got:], n - got)
        if not k:
            raise ConnectionError("memory tier: the peer closed the connection mid-transfer")
        got += k
    return buf


def _send_blob(sock: socket.socket, header: dict, payload: np.ndarray) -> None:
    raw = json.dumps(header).encode()
    sock.sendall(_LEN.pack(len(raw)) + raw)
    sock.sendall(memoryview(payload))


def _recv_blob(sock: socket.socket, reuse: np.ndarray | None = None) -> tuple[dict, np.ndarray]:
    raw = bytes(_recv_exact(sock, _LEN.unpack(bytes(_recv_exact(sock, _LEN.size)))[0]))
    header = json.loads(raw)
    size = int(header["bytes"])
    payload = reuse if reuse is not None and len(reuse) == size else new_payload(size)
    if size:
        _recv_exact(sock, size, memoryview(payload))
    return header, payload


class ReplicaServer:
    """This rank's listener: holds the ``KEPT`` newest replicas a peer puts, and hands one back to
    whoever asks (the peer's replacement). A put is received into the memory of the oldest, never of
    the newest: a peer lost in the middle of its put leaves the replica before it whole. One
    connection at a time, on a daemon thread."""

    def __init__(self, host: str = "127.0.0.1"):
        self.sock = socket.create_server((host, 0))
        self.address = f"{host}:{self.sock.getsockname()[1]}"
        self.replicas: list[tuple[dict, np.ndarray]] = []  # (header with the owner's tag, payload), newest first
        self.lock = threading.Lock()
        threading.Thread(target=self._serve, name="memory-tier-replica", daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                try:
                    conn.settimeout(SOCKET_TIMEOUT_SECONDS)
                    self._answer(conn)
                except (OSError, ValueError, ConnectionError) as err:
                    print(f"relaunch: memory tier: a replica transfer failed: {err}", file=sys.stderr, flush=True)

    @property
    def replica(self) -> tuple[dict, np.ndarray] | None:
        """The newest replica held."""
        with self.lock:
            return self.replicas[0] if self.replicas else None

    def _held(self, owner: int) -> list[tuple[dict, np.ndarray]]:
        with self.lock:
            return [held for held in self.replicas if held[0].get("owner") == owner]

    def _answer(self, conn: socket.socket) -> None:
        op, owner, step = _HEAD.unpack(bytes(_recv_exact(conn, _HEAD.size)))
        if op == b"P":
            with self.lock:  # received into the oldest replica's memory when it fits, the newest kept whole
                if self.replicas and self.replicas[0][0].get("owner") != owner:
                    self.replicas = []  # the ring changed: another peer's now
                spare = self.replicas.pop() if len(self.replicas) >= KEPT else None
            header, payload = _recv_blob(conn, spare[1] if spare is not None else None)
            header["owner"] = owner
            with self.lock:
                self.replicas.insert(0, (header, payload))
            conn.sendall(b"k")
        elif op == b"L":
            raw = json.dumps([[h["step"], h.get("fingerprint")] for h, _ in self._held(owner)]).encode()
            conn.sendall(_LEN.pack(len(raw)) + raw)
        elif op == b"G":
            held = [h for h in self._held(owner) if step < 0 or h[0]["step"] == step][:1]
            if not held:
                conn.sendall(_LEN.pack(0))
                return
            _send_blob(conn, held[0][0], held[0][1])

    def close(self) -> None:
        with contextlib.suppress(OSError):  # wakes the accept() of the server thread, which then ends
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


def _connect(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=SOCKET_TIMEOUT_SECONDS)


def put_replica(address: str, owner: int, header: dict, payload: np.ndarray) -> None:
    """Hand ``owner``'s packed snapshot to the replica server at ``address``."""
    with _connect(address) as sock:
        sock.sendall(_HEAD.pack(b"P", owner, -1))
        _send_blob(sock, header, payload)
        if _recv_exact(sock, 1).tobytes() != b"k":
            raise ConnectionError("memory tier: the holder did not take the replica")


def list_replicas(address: str, owner: int) -> list[tuple[int, str | None]]:
    """The (step, fingerprint) of each of ``owner``'s replicas the server at ``address`` holds, newest first."""
    with _connect(address) as sock:
        sock.sendall(_HEAD.pack(b"L", owner, -1))
        size = _LEN.unpack(bytes(_recv_exact(sock, _LEN.size)))[0]
        return [(int(step), fp) for step, fp in json.loads(bytes(_recv_exact(sock, size)))]


def get_replica(address: str, owner: int, step: int = -1) -> tuple[dict, np.ndarray] | None:
    """``owner``'s replica of ``step`` (-1: the newest) from the server at ``address``, or None when it
    holds none such."""
    with _connect(address) as sock:
        sock.sendall(_HEAD.pack(b"G", owner, step))
        size = _LEN.unpack(bytes(_recv_exact(sock, _LEN.size)))[0]
        if size == 0:
            return None
        header = json.loads(bytes(_recv_exact(sock, size)))
        payload = new_payload(int(header["bytes"]))
        if len(payload):
            _recv_exact(sock, len(payload), memoryview(payload))
        return header, payload


# ------------------------------------------------------------------------------------ the tier


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
