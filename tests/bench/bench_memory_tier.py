"""Memory tier: a restore from a peer's replica against a raw transfer of the same bytes over the same transport.

The state is a model with AdamW after one step (parameters and two moments, 3x the parameters). A
replacement's restore is: fetch its replica from the holder's server over TCP (loopback here), then
copy it into a freshly built model and optimizer (``restore_into``). The limit for the
same work on this machine is the raw transfer of the same number of bytes over the same kind of
socket into memory as fresh (allocated inside the timing; the faster of leaving it untouched, each
page faulting inside the receive's copy, and writing it first, the pages faulting in bulk; both ends in
timeout mode, as the tier's sockets). Best of REPEATS interleaved samples on each side. Every row is
measured side by side in this run; ``ratio`` is limit / restore (1.0: the restore costs no more than moving its bytes into memory as fresh as
the replacement's; a row into pre-touched memory shows what the page faults cost). A survivor's restore
(its own snapshot copied into the model and optimizer it already holds, whose live tensors its snapshots
found once before the failure: no allocation, no page fault) is
set against a raw copy of the same bytes into pre-touched buffers (one ``copy_`` of the whole payload,
the limit of moving those bytes within this process); goal >= 0.8. The memory row is what the tier holds
per rank from its second snapshot on: its own two newest plus a peer's two newest replicas, against the
shard (4x: a rank lost while handing its newest over is served at the one before).
"""

from __future__ import annotations

import datetime
import os
import socket
import threading
import time

import torch
import torch.distributed as dist

from relaunch.components.core.recovery.memory_tier import MemoryTier
from relaunch.components.core.recovery.packing import restore_into
from relaunch.components.core.checkpoint.snapshot import Snapshotter
from relaunch.components.core.trainer.state import TrainingState
from tests.services import free_port

REPEATS = 5  # interleaved, best of each: fresh memory's fault cost swings several-fold between allocations here
SURVIVOR_REPEATS = 15  # 20-60 ms each: more samples, as the copies are short


def build_state(mib: int) -> TrainingState:
    """A model of about ``mib`` MiB of float32 parameters, AdamW stepped once (its moments exist)."""
    width = 1024
    layers = max(1, (mib << 20) // (width * width * 4))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, width)).sum().backward()
    optimizer.step()
    return TrainingState(model, optimizer)


def raw_transfer_seconds(payload: bytearray, *, fresh: bool) -> float:
    """Send ``len(payload)`` bytes over a loopback TCP socket into a buffer: allocated inside the timing
    (``fresh``: equally fresh memory, as a replacement process has) or allocated and touched before."""
    # fresh: the faster of two ways into new memory, both timed from the allocation: torch.empty left
    # untouched (each page faults inside the receive's copy) or written first (zero_, the pages fault
    # in bulk, as bytearray(n) does); on this machine either can be the faster one
    if fresh:
        return min(_receive(payload, touch=False), _receive(payload, touch=True))
    return _receive(payload, touch=True, before=True)


def _receive(payload: bytearray, *, touch: bool, before: bool = False) -> float:
    """One raw transfer of ``payload`` over loopback TCP into a buffer allocated (and written when
    ``touch``) inside the timing, or before it (``before``)."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    into = torch.empty(len(payload), dtype=torch.uint8).fill_(1) if before else None

    def send() -> None:
        conn, _ = server.accept()
        with conn:
            conn.settimeout(60)
            conn.sendall(memoryview(payload))

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    began = time.perf_counter()
    if into is None:
        into = torch.empty(len(payload), dtype=torch.uint8)
        if touch:
            into.zero_()
    # both ends in timeout mode (poll, then a non-blocking call), as the tier's: on loopback here
    # ~30 % faster than blocking sockets for the same bytes (a blocking raw side was beaten by ours)
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        view, got = memoryview(into.numpy()), 0
        while got < len(into):
            got += sock.recv_into(view[got:], len(into) - got)
    seconds = time.perf_counter() - began
    thread.join()
    server.close()
    return seconds


def run(quick: bool = False) -> list[dict]:
    mib = int(os.environ.get("BENCH_MEMORY_TIER_MIB", 16 if quick else 128))
    registry = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=60))
    state = build_state(mib)
    owner, holder = MemoryTier(0, 2, registry), MemoryTier(1, 2, registry)
    owner.keep(1, Snapshotter().take(state), None)
    shard = owner.bytes_held()["own"]
    owner.keep(2, Snapshotter().take(state), None)  # two of each kind held from the second snapshot on
    restores, raws, touched, survivors, copies = [], [], [], [], []
    try:
        own, _ = owner.own_or_from_holder()
        source = torch.frombuffer(own[1], dtype=torch.uint8)
        held_copy = torch.empty_like(source).fill_(1)  # pre-touched, as a survivor's tensors are
        live = state.live_tensors()  # a survivor's snapshots found them once, before the failure
        for _ in range(SURVIVOR_REPEATS):
            began = time.perf_counter()
            restore_into(state, *own, live=live)
            survivors.append(time.perf_counter() - began)
            began = time.perf_counter()
            held_copy.copy_(source)
            copies.append(time.perf_counter() - began)
        for _ in range(REPEATS):
            fresh_state = build_state(mib)  # the replacement's freshly built model and optimizer
            replacement = MemoryTier(0, 2, registry)
            began = time.perf_counter()
            fetched, where = replacement.own_or_from_holder()
            restore_into(fresh_state, *fetched)
            restores.append(time.perf_counter() - began)
            assert where == "replica on rank 1"
            replacement.close()
            raws.append(raw_transfer_seconds(fetched[1], fresh=True))
            touched.append(raw_transfer_seconds(fetched[1], fresh=False))
        memory = holder.bytes_held()
        owner_memory = owner.bytes_held()
    finally:
        owner.close()
        holder.close()
    restore, raw, raw_touched = min(restores), min(raws), min(touched)
    survivor, copy = min(survivors), min(copies)  # best of SURVIVOR_REPEATS each, interleaved (short copies: noise)
    gib = shard / (1 << 30)
    return [
        {"what": "survivor: its own snapshot into the model/optimizer it holds (goal >= 0.8)", "bytes": shard,
         "seconds": survivor, "GiB/s": gib / survivor, "ratio": copy / survivor},
        {"what": "raw copy of the same bytes into pre-touched memory (limit)", "bytes": shard, "seconds": copy,
         "GiB/s": gib / copy, "ratio": 1.0},
        {"what": "restore from the peer's replica (fetch + into a fresh model/optimizer)", "bytes": shard,
         "seconds": restore, "GiB/s": gib / restore, "ratio": raw / restore},
        {"what": "raw TCP transfer of the same bytes into fresh memory (limit)", "bytes": shard, "seconds": raw,
         "GiB/s": gib / raw, "ratio": 1.0},
        {"what": "raw TCP transfer into pre-touched memory (for scale)", "bytes": shard, "seconds": raw_touched,
         "GiB/s": gib / raw_touched, "ratio": raw / raw_touched},
        {"what": "tier memory per rank: 2 own + 2 replicas (x shard)", "bytes": owner_memory["own"] + memory["replica"],
         "seconds": 0.0, "GiB/s": 0.0, "ratio": (owner_memory["own"] + memory["replica"]) / shard},
    ]
