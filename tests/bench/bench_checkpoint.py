"""Checkpoint core: stall, throughput, locate and sharded restore, measured side by side in one run.

Size: ``BENCH_CHECKPOINT_MIB`` (default 256; 32 with --quick), e.g.
``BENCH_CHECKPOINT_MIB=1024 make bench ARGS=checkpoint`` for the issue's >= 1 GiB state (needs ~4x
that in free memory; too heavy for a shared 2-core machine).

- stall: seconds the training thread is blocked by ``CheckpointManager.save`` (async) divided by the
  seed's synchronous way (``torch.save`` of the whole state to a local file, then upload to the store)
  for the same state (256 MiB; 32 MiB with --quick). Goal <= 0.02.
- throughput: raw sequential write (with fsync) / read of the same number of bytes to the same place,
  divided by our save (end to end: snapshot, DCP write with chunk digests, fsync, manifest, pointer) /
  restore (locate + DCP load checking every chunk digest as it arrives). Goal >= 0.9. On S3 the raw
  side GETs every object of the checkpoint whole, 8 in flight, from the same server (the fastest way
  on moto, which spends time in proportion to the object's size on every ranged GET). Both restore
  sides read into memory that exists already (see ``_restore_rows``); on the filesystem with the page
  cache warm and, as a second row, cold (``posix_fadvise(DONTNEED)`` first, on the raw file / on every
  file under ``checkpoints/``).
- locate: store requests and seconds of ``latest()`` with 10 and with 10,000 checkpoints present
  (S3: 10 and 1,000; --quick: 10 and 1,000 / 100). Goal: the same small number of requests.
- sharded restore (FSDP2, torchrun, gloo): the same total state saved by 2 ranks, loaded by 1, 2 and 4:
  restore / raw sequential read of the same files (warm cache), kill -> state loaded on 4 ranks / on 1
  (goal <= 1.2; split into torchrun + interpreter start and the worker's own part), and each rank's
  peak RSS growth during the load / its share (goal <= 1.1). The load is timed, and its RSS baseline
  taken, after the worker imported the checkpoint modules (a per-process cost, inside "kill -> state
  loaded"); the optimizer state it allocates is inside both.
- replicated (DDP) restore on 4 ranks: read by every rank, once per node (2 nodes of 2), once per job;
  bytes read from the store and the slowest rank's load time, side by side.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from components.core.checkpoint import CheckpointManager, step_key
from components.core.store import open_store


def _state(total_bytes: int) -> dict[str, dict[str, torch.Tensor]]:
    n = 16
    per = total_bytes // n // 4
    g = torch.Generator().manual_seed(0)
    return {"model": {f"layer{i}.weight": torch.randn(per, generator=g) for i in range(n)}}


def _nbytes(state) -> int:
    return sum(t.numel() * t.element_size() for t in state["model"].values())


def _log(msg: str) -> None:
    print(f"  bench_checkpoint: {msg}", file=sys.stderr, flush=True)


def _stall_and_throughput(root: str, state, work: Path, label: str) -> list[dict]:
    store = open_store(root)
    nbytes = _nbytes(state)
    # the seed's way: torch.save the whole state, then upload it
    t0 = time.perf_counter()
    local = work / "seed.pt"
    torch.save(state, local)
    store.upload_file("seed/state.pt", local)
    seed_seconds = time.perf_counter() - t0
    store.delete("seed/state.pt")

    mgr = CheckpointManager(store, keep_last=1, owner="bench", cache_dir=work / "cache")
    mgr.save(1, state)  # warm-up: allocates the reusable snapshot buffers
    mgr.wait()
    stall = []
    save_seconds = []
    for step in (2, 3):
        t0 = time.perf_counter()
        mgr.save(step, state)
        stall.append(time.perf_counter() - t0)
        mgr.wait()
        save_seconds.append(time.perf_counter() - t0)
    stall_s, save_s = min(stall), min(save_seconds)
    mgr.close()
    overlapped = {reads: _overlapped_stall(f"{root}-overlap{reads}", state, work, reads) for reads in (3, 1)}

    # raw sequential write (fsync) of the same bytes to the same place
    blob = b"".join(t.numpy().tobytes() for t in state["model"].values())
    raw_local = work / "raw.bin"
    t0 = time.perf_counter()
    _write_file(raw_local, blob)
    if not hasattr(store, "path"):  # S3: the same bytes as one plain upload
        store.upload_file("raw/raw.bin", raw_local)
    raw_write = time.perf_counter() - t0
    if hasattr(store, "path"):  # the same place: write straight into the store's directory
        dest = store.path("raw/raw.bin")
        dest.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        _write_file(dest, blob)
        raw_write = time.perf_counter() - t0
    del blob
    mib = nbytes / 2**20
    rows = [
        {"metric": f"stall ratio, copy in save() ({label})", "value": stall_s / seed_seconds, "goal": "<= 0.02",
         "detail": f"save() blocked {stall_s * 1e3:.1f} ms vs torch.save+upload {seed_seconds:.2f} s, {mib:.0f} MiB"},
        *({"metric": f"stall ratio, copy overlapped with a {reads}-read step ({label})",
           "value": o["stall"] / seed_seconds, "goal": "<= 0.02" if reads == 3 else "measured",
           "detail": f"save() {o['save'] * 1e3:.1f} ms + blocked before the optimizer step "
                     f"{o['blocked'] * 1e3:.1f} ms, behind a {o['step'] * 1e3:.0f} ms simulated forward/backward"}
          for reads, o in overlapped.items()),
        {"metric": f"save throughput ratio ({label})", "value": raw_write / save_s, "goal": ">= 0.9 (fs)",
         "detail": f"raw write {raw_write:.2f} s vs save end to end {save_s:.2f} s"},
    ]
    rows += _restore_rows(root, store, state, work, label)
    store.delete("raw/raw.bin")
    return rows


def _overlapped_stall(root: str, state, work: Path, reads: int) -> dict[str, float]:
    """The trainer's stall with ``save(defer_copy=True)``: time in save() plus time blocked in
    ``wait_for_snapshot()`` before the next optimizer step, with a simulated forward and backward in
    between that sums every parameter ``reads`` times. A real step reads each parameter at least 3
    times (forward, input gradient, weight gradient) and does far more arithmetic than a sum, so
    3 reads is a lower bound of the step of any model of this size (1 read: a harsher case still).
    Best of 2, after a warm-up save."""
    model = torch.nn.Module()
    for name, tensor in state["model"].items():  # parameters sharing the state's memory: the same bytes
        layer, _, attr = name.partition(".")
        child = torch.nn.Module()
        child.register_parameter(attr, torch.nn.Parameter(tensor, requires_grad=False))
        model.add_module(layer, child)
    params = list(model.parameters())

    def forward_backward() -> float:
        t0 = time.perf_counter()
        for _ in range(reads):
            for p in params:
                p.sum()
        return time.perf_counter() - t0

    best: dict[str, float] | None = None
    mgr = CheckpointManager(root, keep_last=1, owner="bench", cache_dir=work / "cache-overlap")
    mgr.save(1, {"model": model}, defer_copy=True)
    mgr.wait()
    for step in (2, 3):
        t0 = time.perf_counter()
        mgr.save(step, {"model": model}, defer_copy=True)
        saved = time.perf_counter() - t0
        step_seconds = forward_backward()
        blocked = mgr.wait_for_snapshot()
        mgr.wait()
        row = {"stall": saved + blocked, "save": saved, "blocked": blocked, "step": step_seconds}
        if best is None or row["stall"] < best["stall"]:
            best = row
    mgr.close()
    return best


def _write_file(path: Path, blob: bytes) -> None:
    with open(path, "wb") as fh:
        for i in range(0, len(blob), 8 << 20):
            fh.write(blob[i:i + (8 << 20)])
        fh.flush()
        os.fsync(fh.fileno())


def _evict(paths) -> bool:
    """Drop the (clean, fsynced) pages of these files from the page cache: the next read is cold."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def _read_into(path: Path, dest: memoryview) -> None:
    with open(path, "rb", buffering=0) as fh:
        done = 0
        while done < len(dest):
            n = fh.readinto(dest[done:])
            if not n:
                raise EOFError(path)
            done += n


def _restore_rows(root: str, store, state, work: Path, label: str) -> list[dict]:
    """Restore vs raw read, side by side and alike on both sides: the same bytes, from the same place,
    into memory that already exists (the model of a restarted job is built before it loads; the raw
    read fills one preallocated buffer of the same size); best of 3 each, interleaved. On the
    filesystem twice: page cache warm (both just written) and cold (both evicted first)."""
    nbytes = _nbytes(state)
    target = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}
    dest = torch.zeros(nbytes, dtype=torch.uint8)
    dest_view = memoryview(dest.numpy())

    def restore() -> float:
        cache = work / f"cache-{time.monotonic_ns()}"  # a fresh reader: nothing verified or downloaded yet
        with CheckpointManager(root, cache_dir=cache) as reader:
            t0 = time.perf_counter()
            reader.load(target)
            seconds = time.perf_counter() - t0
        shutil.rmtree(cache, ignore_errors=True)
        return seconds

    if not hasattr(store, "path"):  # S3: parallel ranged GETs of the same objects vs locate+load
        sizes = store.sizes(step_key(3))
        raw, ours = [], []
        for _ in range(2):
            t0 = time.perf_counter()
            _parallel_get(store, sizes, dest)
            raw.append(time.perf_counter() - t0)
            ours.append(restore())
        assert all(torch.equal(target["model"][k], v) for k, v in state["model"].items())
        return [{"metric": f"restore throughput ratio ({label})", "value": min(raw) / min(ours),
                 "goal": ">= 0.9",
                 "detail": f"raw parallel GETs of the whole {len(sizes)} objects {min(raw):.2f} s vs "
                           f"locate+load with digests {min(ours):.2f} s"}]
    raw_path = store.path("raw/raw.bin")
    ckpt_files = [p for p in store.path(step_key(3)).iterdir() if p.is_file()]
    every_file = [p for p in store.path("checkpoints").rglob("*") if p.is_file()]  # + latest.json, ...
    rows = []
    for cold in (False, True):
        raw, ours = [], []
        for _ in range(3):
            if cold:
                _evict([raw_path])
            t0 = time.perf_counter()
            _read_into(raw_path, dest_view)
            raw.append(time.perf_counter() - t0)
            if cold:
                _evict(every_file)
            ours.append(restore())
        assert all(torch.equal(target["model"][k], v) for k, v in state["model"].items())
        cache = "cold" if cold else "warm"
        rows.append({
            "metric": f"restore throughput ratio ({label}{', cold cache' if cold else ''})",
            "value": min(raw) / min(ours), "goal": ">= 0.9 (fs)",
            "detail": f"page cache {cache} on both sides: raw read into a preallocated buffer {min(raw):.3f} s "
                      f"vs locate+load (chunk digests checked) into the existing model {min(ours):.3f} s "
                      f"({len(ckpt_files)} files, {nbytes / min(ours) / 1e9:.2f} GB/s)"})
    return rows


def _parallel_get(store, sizes: dict[str, int], dest: torch.Tensor) -> None:
    """Every object whole, up to 8 GETs in flight, into one preallocated buffer. (Whole objects: the
    S3 test server, moto, spends time in proportion to the object's size on every ranged GET, so
    one GET per object is the fastest way to read them there; our reader asks for whole files too
    when it needs them whole.)"""
    jobs, at = [], 0
    for key, size in sorted(sizes.items()):
        jobs.append((key, at, size))
        at += size
    buf = torch.empty(at, dtype=torch.uint8) if at > dest.numel() else dest
    view = memoryview(buf.numpy())
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda j: store.read_into(j[0], 0, view[j[1]:j[1] + j[2]]), jobs))


def _torchrun(nproc: int, *args: str) -> float:
    """Run the sharded-checkpoint worker; returns the wall time the command was started at."""
    root = Path(__file__).resolve().parents[2]
    started = time.time()
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node", str(nproc),
           "-m", "tests.core.fsdp_worker", *args, "--no-dump"]
    proc = subprocess.run(cmd, cwd=root, env={**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        raise RuntimeError(f"torchrun {nproc}: {proc.stderr[-1500:]}")
    return started


def _sharded_rows(total_bytes: int, work: Path) -> list[dict]:
    """FSDP2 state of ``total_bytes`` (model + AdamW moments) saved by 2 ranks, loaded by 1, 2, 4."""
    width = max(64, total_bytes // 252)  # Linear(16, w) + Linear(w, 4): 21 w floats, x3 with AdamW
    root = str(work / "sharded-store")
    _torchrun(2, "--root", root, "--out", str(work / "sharded-save"), "--steps", "1", "--save-at", "1",
              "--width", str(width))
    files = sorted(open_store(root).path(step_key(1)).glob("__*.distcp"))
    dest = torch.empty(sum(f.stat().st_size for f in files), dtype=torch.uint8)
    view = memoryview(dest.numpy())
    raws = []
    for _ in range(3):  # warm cache, like the restores right after it; the best of 3
        at, t0 = 0, time.perf_counter()
        for f in files:
            size = f.stat().st_size
            _read_into(f, view[at:at + size])
            at += size
        raws.append(time.perf_counter() - t0)
    raw = min(raws)
    rows, to_loaded, in_process, loads = [], {}, {}, {}
    for nproc in (1, 2, 4):
        out = work / f"sharded-load-{nproc}"
        started = _torchrun(nproc, "--root", root, "--out", str(out), "--resume", "--width", str(width))
        ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]
        load = max(r["load_seconds"] for r in ranks)
        to_loaded[nproc] = max(r["loaded_at"] for r in ranks) - started
        in_process[nproc] = max(r["loaded_at"] - r["process_started"] for r in ranks)
        loads[nproc] = load
        rss = max((r["rss_peak_during_load"] - r["rss_before_load"]) / r["share_bytes"] for r in ranks)
        rows.append({"metric": f"sharded restore throughput ratio (fs, {nproc} rank{'s' * (nproc > 1)})",
                     "value": raw / load, "goal": ">= 0.9",
                     "detail": f"raw sequential read of the {len(files)} files {raw:.2f} s vs the slowest rank's "
                               f"load {load:.2f} s, {dest.numel() / 2**20:.0f} MiB"})
        rows.append({"metric": f"peak RSS growth / share ({nproc} rank{'s' * (nproc > 1)})", "value": rss,
                     "goal": "<= 1.1", "detail": f"share {ranks[0]['share_bytes'] / 2**20:.0f} MiB per rank"})
    rows.append({"metric": "kill -> state loaded, 4 ranks / 1 rank", "value": to_loaded[4] / to_loaded[1],
                 "goal": "<= 1.2", "detail": ", ".join(f"{n}: {s:.1f} s" for n, s in to_loaded.items())
                 + f" (torchrun, process start, imports, process group, locate, load; {os.cpu_count()} cores)"})
    rows.append({"metric": "  of which from the worker's first line on, 4 ranks / 1 rank",
                 "value": in_process[4] / in_process[1], "goal": "(split of the row above)",
                 "detail": ", ".join(f"{n}: {s:.2f} s (load {loads[n]:.2f} s)" for n, s in in_process.items())
                 + "; the rest is torchrun and the interpreter starting"})
    return rows


def _replicated_rows(total_bytes: int, work: Path) -> list[dict]:
    """A DDP state saved by 4 ranks, loaded by 4 with 1, 2 and 4 ranks per "node"."""
    width = max(64, total_bytes // 252)
    root = str(work / "replicated-store")
    _torchrun(4, "--root", root, "--out", str(work / "replicated-save"), "--parallelism", "ddp", "--steps", "1",
              "--save-at", "1", "--width", str(width))
    rows, seconds = [], {}
    for per_node, label in ((1, "every rank reads"), (2, "once per node"), (4, "once per job")):
        out = work / f"replicated-load-{per_node}"
        _torchrun(4, "--root", root, "--out", str(out), "--parallelism", "ddp", "--resume", "--width", str(width),
                  "--ranks-per-node", str(per_node))
        ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
        seconds[per_node] = max(r["load_seconds"] for r in ranks)
        read = sum(r["stats"].get("bytes_read", 0) for r in ranks)
        rows.append({"metric": f"replicated restore, 4 ranks, {label}: load / every-rank load",
                     "value": seconds[per_node] / seconds[1], "goal": "measured (choice)",
                     "detail": f"slowest rank {seconds[per_node]:.2f} s, {read / 2**20:.0f} MiB read from the store"})
    return rows


def _fake_checkpoints(root: str, n: int) -> None:
    """n tiny committed checkpoints (a data file and a valid manifest each) and a pointer."""
    store = open_store(root)
    data = b"x" * 64
    digest = hashlib.sha256(data).hexdigest()
    body = b""
    for step in range(1, n + 1):
        key = step_key(step * 10)
        manifest = {"format_version": 1, "step": step * 10, "epoch": 0, "world_size": 1, "created_at": "",
                    "files": {"__0_0.distcp": {"size": len(data), "sha256": digest}}, "metrics": {}}
        body = json.dumps(manifest).encode()
        if hasattr(store, "path"):
            d = store.path(key)
            d.mkdir(parents=True, exist_ok=True)
            (d / "__0_0.distcp").write_bytes(data)
            (d / "MANIFEST.json").write_bytes(body)
        else:
            store.write_bytes(f"{key}/__0_0.distcp", data)
            store.write_bytes(f"{key}/MANIFEST.json", body)
    store.write_bytes("checkpoints/latest.json", json.dumps(
        {"step": n * 10, "path": step_key(n * 10), "manifest_sha256": hashlib.sha256(body).hexdigest()}).encode())


def _locate(root: str, n: int, label: str) -> dict:
    _fake_checkpoints(root, n)
    mgr = CheckpointManager(root)
    before = mgr.store.stats["requests"]
    t0 = time.perf_counter()
    info = mgr.latest()
    seconds = time.perf_counter() - t0
    assert info.step == n * 10
    mgr.close()
    return {"metric": f"locate requests ({label}, {n} checkpoints)", "value": mgr.store.stats["requests"] - before,
            "goal": "same for both", "detail": f"{seconds * 1e3:.1f} ms"}


def run(quick: bool) -> list[dict]:
    """Rows of the benchmark table (see the module docstring)."""
    size = int(os.environ.get("BENCH_CHECKPOINT_MIB") or (32 if quick else 256)) << 20
    work = Path(tempfile.mkdtemp(prefix="bench-ckpt-"))
    rows: list[dict] = []
    server = None
    try:
        state = _state(size)
        _log(f"stall/throughput on the filesystem, {size >> 20} MiB")
        rows += _stall_and_throughput(str(work / "fs-store"), state, work, "fs")
        for n in (10, 1000 if quick else 10000):
            _log(f"locate on the filesystem with {n} checkpoints")
            rows.append(_locate(str(work / f"locate-{n}"), n, "fs"))
        _log(f"sharded (FSDP2) restore on 1, 2 and 4 ranks, {size >> 20} MiB")
        rows += _sharded_rows(size, work)
        _log(f"replicated (DDP) restore on 4 ranks: per rank, per node, per job, {size >> 20} MiB")
        rows += _replicated_rows(size, work)
        try:
            from tests.services import S3Server

            server = S3Server().start()
            server.create_bucket("bench")
            os.environ.update(server.env())
        except Exception as err:  # noqa: BLE001 - S3 rows are optional where moto cannot start
            _log(f"S3 server unavailable, S3 rows skipped: {err}")
            server = None
        if server:
            _log("stall/throughput on S3 (moto over HTTP)")
            rows += _stall_and_throughput("s3://bench/run", state, work, "s3")
            for n in (10, 100 if quick else 1000):
                _log(f"locate on S3 with {n} checkpoints")
                rows.append(_locate(f"s3://bench/locate-{n}", n, "s3"))
    finally:
        if server:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)
    return rows
