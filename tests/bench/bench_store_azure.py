"""Checkpoint restore and save on an az:// store against the raw Azure SDK, side by side on one Azurite.

    python -m tests.bench store_azure [--quick]      # BENCH_AZURE_MIB sets the size (64; 16 quick)

Restore ratio = (raw time) / (our time): raw is ``azure-storage-blob`` alone (no relaunch code)
downloading every blob of the checkpoint's folder into buffers allocated before the timed region,
with as many downloads in flight as our reader has GETs in flight; ours is a fresh
``CheckpointManager`` loading the latest checkpoint into an existing state (locate, manifest,
metadata, planning, reads, every chunk digest checked). Save ratio = (raw time) / (our time): raw
uploads blobs of the same sizes with the same concurrency; ours is a synchronous ``save()`` (the
state's bytes, digests, metadata, manifest, latest pointer). Interleaved, best of 5 each. Azurite
(Node, in memory) is the bottleneck of both sides here: the ratios say what relaunch adds on top of
the SDK, not what Azure itself would give.
"""

from __future__ import annotations

import concurrent.futures
import os
import sys
import time
import uuid
from typing import Any

import torch

from relaunch.components.core.checkpoint import CheckpointManager
from tests.bench import on_emulator
from tests.bench.bench_checkpoint import _interleaved, _restore_once, _row, _state, our_concurrency


def _log(msg: str) -> None:
    print(f"  bench_store_azure: {msg}", file=sys.stderr, flush=True)


class _Into:
    """A seekable, writable stream over a preallocated buffer (what the SDK's ``readinto`` wants)."""

    def __init__(self, buffer: bytearray):
        self.view, self.pos = memoryview(buffer), 0

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = offset
        return offset

    def tell(self) -> int:
        return self.pos

    def write(self, data: Any) -> int:
        n = len(data)
        self.view[self.pos:self.pos + n] = data
        self.pos += n
        return n


def run(quick: bool) -> list[dict]:
    """Rows of the benchmark table (see the module docstring)."""
    from tests.azure_server import AzuriteServer

    mib = int(os.environ.get("BENCH_AZURE_MIB") or (16 if quick else 64))
    _, in_flight = our_concurrency()
    server = AzuriteServer().start()
    with on_emulator(server, server.env(), "bench-azure-") as work:
        container = server.client().get_container_client(server.create_container("bench"))
        state = _state(mib << 20)
        root = f"az://bench/run-{uuid.uuid4().hex[:6]}"
        with CheckpointManager(root, owner="bench", async_save=False, keep_last=0) as mgr:
            info = mgr.save(1, state) or mgr.latest()
            prefix = mgr.store.prefix
            objects = sorted((f"{prefix}/{key}", size) for key, size in mgr.store.sizes(info.key).items())
        nbytes = sum(size for _, size in objects)
        buffers = {name: bytearray(size) for name, size in objects}
        pool = concurrent.futures.ThreadPoolExecutor(in_flight)

        def raw_restore() -> float:
            t0 = time.perf_counter()
            list(pool.map(lambda o: container.get_blob_client(o[0]).download_blob(max_concurrency=1)
                          .readinto(_Into(buffers[o[0]])), objects))
            return time.perf_counter() - t0

        target = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}
        _log(f"restore, {mib} MiB, {len(objects)} blobs, {in_flight} in flight")
        times = _interleaved({"raw": raw_restore, "ours": lambda: _restore_once(root, target, work / "cache")})
        assert all(torch.equal(target["model"][k], v) for k, v in state["model"].items()), "restore differs"
        r, o = min(times["raw"]), min(times["ours"])
        rows = [_row("restore", "restore / raw SDK, Azure (Azurite)", r / o,
                     f"azure-storage-blob downloads of the {len(objects)} blobs, {in_flight} in flight, {r:.3f} s "
                     f"({nbytes / r / 1e6:.0f} MB/s) vs ours {o:.3f} s ({nbytes / o / 1e6:.0f} MB/s)")]

        step = iter(range(2, 10**6))
        raw_prefix = f"raw-{uuid.uuid4().hex[:6]}"

        def raw_save() -> float:
            t0 = time.perf_counter()
            list(pool.map(lambda o: container.upload_blob(f"{raw_prefix}/{o[0]}", bytes(buffers[o[0]]),
                                                          overwrite=True, max_concurrency=1), objects))
            return time.perf_counter() - t0

        writer = CheckpointManager(root, owner="bench", async_save=False, keep_last=1)

        def our_save() -> float:
            t0 = time.perf_counter()
            writer.save(next(step), state)
            return time.perf_counter() - t0

        _log("save, synchronous")
        times = _interleaved({"raw": raw_save, "ours": our_save})
        writer.close()
        pool.shutdown()
        r, o = min(times["raw"]), min(times["ours"])
        rows.append(_row(None, "save / raw SDK, Azure (Azurite)", r / o,
                         f"azure-storage-blob uploads of blobs of the same sizes, {in_flight} in flight, {r:.3f} s "
                         f"vs our synchronous save {o:.3f} s"))
        return rows
