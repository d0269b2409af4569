"""Checkpoint restore and save stall against this machine's limit, measured side by side in one run.

    python -m tests.bench checkpoint [--size-mib N]     # make bench ARGS="checkpoint --size-mib N"

Size: ``--size-mib`` or ``BENCH_CHECKPOINT_MIB`` (default 1024, the size the goals are stated at;
64 with --quick). Needs about 4x that in free memory and disk. Work files go under
``BENCH_CHECKPOINT_DIR`` (default: the system temp dir; it must be a real disk, not tmpfs, for the
cold rows).

Every restore ratio is (raw time) / (our time) for the same bytes, where the raw side is the limit
of this machine, measured with none of relaunch's code (tests/bench/rawread.py):

- the same files' bytes (every file of the checkpoint's folder; on S3 every object), read by an
  independent reader with the same concurrency as ours: as many threads as our reader has, each
  reading one piece (at most 64 MiB, our largest single read, and small enough that every thread
  has one) front to back with ``os.preadv``, in 512 KiB and, as a second raw variant, in 8 MiB
  blocks (the faster of the two is the limit); on S3 plain ``http.client`` GETs of whole objects
  (presigned by boto3), as many in flight as our reader's GETs, and as a second variant the same GETs
  each asking for the range of all the object's bytes (what ours sends); for N ranks, N reader processes, each with its 1/N share of the bytes, timed like our ranks
  (the slowest one's own time from its start);
- into buffers allocated and page-faulted before the timed region (ours: the model, which a
  restarted job builds before it loads, exists before the timed region too);
- page-cache state set and verified with ``mincore`` right before every timed read, on both sides:
  warm = every byte resident (read through first), cold = none (``posix_fadvise(DONTNEED)`` after
  a write-back); the resident fraction measured is printed in the row;
- ours and the baseline interleaved (raw, ours, raw, ours, ...) and the best of 5 each, every side
  started after an ``os.sync()`` (the write-back and file deletions of a save before it no longer
  run under the next side: a copy limit once read 28 % slower than the same copy in ``save()``).

Ours is a fresh ``CheckpointManager`` loading the latest checkpoint into an existing state: locate,
manifest, metadata, planning, reads, and every chunk digest checked. A restore ratio above 1.0
means the baseline is not the limit: the row says so (a bug of the baseline until explained).

Save stall: the seconds ``save()`` blocks the training thread (default async save, copy in save())
and, with ``save(defer_copy=True)``, ``save()`` plus ``wait_for_snapshot()`` after a simulated
forward and backward that reads every parameter 3 times, both divided by a synchronous save of the
same state (``torch.save`` to a local file, then upload to the store: what the goal is stated
against); both are also shown divided by our own synchronous save (``async_save=False``). The
stall's own floor is a plain copy of the same bytes into pre-faulted buffers (the fastest of
torch's threaded ``copy_``, one memcpy per tensor, 4 MiB slices over a thread per core (handed
out by an executor, or taken in turn off a shared counter by threads started before the timed
region, into the bench's buffers and into the very staging buffers ``save()`` copies into), and one
piece per core of each tensor): the limit row. All are interleaved, best of 5,
after a warm-up save of each manager (its buffers allocated and faulted).

FSDP2 (torchrun, gloo, tests/core/fsdp_worker.py): the state saved by 2 ranks, restored by 2 and 4;
the load's time is the slowest rank's, from after its imports; bytes read by each rank from the
store against its share (the checkpoint's bytes / ranks), and its peak RSS growth against the state
it holds. A measured row beside the goal's shows the same raw read with the optimizer state's part
of each buffer (the fraction ``.metadata`` gives) never touched before it: the memory a load must
allocate (AdamW has no state before its first step) faults page by page while it is read, which the
pre-faulted limit leaves out.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import importlib
import itertools
import json
import os
import pkgutil
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from relaunch.components.core.checkpoint import CheckpointManager
from relaunch.components.core.store import open_store
from tests.bench import rawread

ROOT = Path(__file__).resolve().parents[2]
ROUNDS = 5  # best of: on this VM one side's round swings 10-30 % with the host's load
GOALS: dict[str, tuple[str, float]] = {  # kind -> (comparison, goal)
    "restore": (">=", 0.9), "bytes": ("<=", 1.1), "rss": ("<=", 1.1),
    "stall": ("<=", 0.02), "deferred": ("<=", 0.005),
}


def _log(msg: str) -> None:
    print(f"  bench_checkpoint: {msg}", file=sys.stderr, flush=True)


def our_concurrency() -> tuple[int, int]:
    """(threads of our filesystem reader, GETs in flight of our S3 reader per rank), as the
    checkpoint package defines them (found in whichever of its modules holds them)."""
    import relaunch.components.core.checkpoint as package

    names = ["manager"] + [m.name for m in pkgutil.iter_modules(package.__path__) if m.name != "manager"]
    for name in names:
        module = importlib.import_module(f"{package.__name__}.{name}")
        if hasattr(module, "IO_THREADS") and hasattr(module, "READ_THREADS"):
            return int(module.IO_THREADS), int(module.READ_THREADS)
    raise RuntimeError("IO_THREADS / READ_THREADS not found in relaunch.components.core.checkpoint: update the bench")


def _row(kind: str | None, metric: str, value: float, detail: str) -> dict[str, Any]:
    if kind in (None, "limit"):  # measured; a "limit" ratio above 1.0 is a baseline that is not one
        bug = kind == "limit" and value > 1.0
        return {"metric": metric, "value": value, "goal": "measured",
                "verdict": "BASELINE BUG: ours beat the limit" if bug else "", "detail": detail}
    op, goal = GOALS[kind]
    ok = value >= goal if op == ">=" else value <= goal
    verdict = "meets" if ok else "MISSES"
    if kind == "restore" and value > 1.0:
        verdict = "BASELINE BUG: ours beat the limit"
    return {"metric": metric, "value": value, "goal": f"{op} {goal:g}", "verdict": verdict, "detail": detail}


def _state(total_bytes: int) -> dict[str, dict[str, torch.Tensor]]:
    n = 16
    per = max(1, total_bytes // n // 4)
    g = torch.Generator().manual_seed(0)
    return {"model": {f"layer{i}.weight": torch.randn(per, generator=g) for i in range(n)}}


def _files(root: str, key: str) -> list[Path]:
    """Every file of a checkpoint's folder on a filesystem store, in the order they were written
    (names with their numbers compared as numbers: ``__0_2`` before ``__0_10``, as our reader reads
    them; in plain name order a cold read jumped between files laid out apart on the disk)."""
    def natural(path: Path) -> list:
        return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", str(path))]

    return sorted((p for p in open_store(root).path(key).rglob("*") if p.is_file()), key=natural)


def _interleaved(sides: dict[str, Callable[[], float]], rounds: int = ROUNDS) -> dict[str, list[float]]:
    """Each side once per round, in the order given, each after an ``os.sync()``, ``rounds`` times:
    {side: seconds per round}."""
    out: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(rounds):
        for name, side in sides.items():
            os.sync()  # what the side before wrote goes to disk now, not under this side
            out[name].append(side())
    return out


def _restore_once(root: str, target: Any, cache: Path) -> float:
    """Our restore, timed: a fresh reader (nothing located, verified or downloaded yet) loads the
    latest checkpoint into ``target``, which exists already."""
    with CheckpointManager(root, cache_dir=cache) as reader:
        t0 = time.perf_counter()
        reader.load(target)
        seconds = time.perf_counter() - t0
    shutil.rmtree(cache, ignore_errors=True)
    return seconds


# ---------------------------------------------------------------------------- save stall
def _stall_rows(state: dict, work: Path) -> list[dict]:
    model = torch.nn.Module()  # parameters sharing the state's memory, for the deferred copy
    for name, tensor in state["model"].items():
        layer, _, attr = name.partition(".")
        child = torch.nn.Module()
        child.register_parameter(attr, torch.nn.Parameter(tensor, requires_grad=False))
        model.add_module(layer, child)
    params = list(model.parameters())
    store = open_store(str(work / "stall-store"))
    asyncs = CheckpointManager(store, keep_last=1, owner="bench", cache_dir=work / "c1")
    deferred = CheckpointManager(str(work / "stall-deferred"), keep_last=1, owner="bench", cache_dir=work / "c2")
    sync = CheckpointManager(str(work / "stall-sync"), keep_last=1, owner="bench", async_save=False,
                             cache_dir=work / "c3")
    steps = {"async": 1, "deferred": 1, "sync": 1}
    asyncs.save(1, state)
    deferred.save(1, {"model": model}, defer_copy=True)
    sync.save(1, state)
    for mgr in (asyncs, deferred):
        mgr.wait()
    step_seconds: list[float] = []

    def torch_save_upload() -> float:
        local = work / "seed.pt"
        t0 = time.perf_counter()
        torch.save(state, local)
        store.upload_file("seed/state.pt", local)
        seconds = time.perf_counter() - t0
        local.unlink()
        store.delete("seed/state.pt")
        return seconds

    def default_async() -> float:
        steps["async"] += 1
        t0 = time.perf_counter()
        asyncs.save(steps["async"], state)
        seconds = time.perf_counter() - t0
        asyncs.wait()
        return seconds

    def deferred_copy() -> float:
        steps["deferred"] += 1
        t0 = time.perf_counter()
        deferred.save(steps["deferred"], {"model": model}, defer_copy=True)
        in_save = time.perf_counter() - t0
        t1 = time.perf_counter()
        for _ in range(3):  # forward, input gradient, weight gradient: each reads every parameter
            for p in params:
                p.sum()
        step_seconds.append(time.perf_counter() - t1)
        blocked = deferred.wait_for_snapshot()
        deferred.wait()
        return in_save + blocked

    def our_sync() -> float:
        steps["sync"] += 1
        t0 = time.perf_counter()
        sync.save(steps["sync"], state)
        return time.perf_counter() - t0

    # the floor of a copy in save(): the same bytes into pre-faulted buffers, by torch's own threaded
    # copy, by one memcpy per tensor (numpy), by 4 MiB slices over a thread per core, and by each tensor
    # cut into one piece per core (no per-slice hand-over), whichever is fastest in each round
    import numpy as np

    sources = list(state["model"].values())
    dests = [torch.empty_like(t).copy_(t) for t in sources]

    slices = [(d.numpy()[at:at + (1 << 20)], src.numpy()[at:at + (1 << 20)])  # 4 MiB of float32
              for d, src in zip(dests, sources) for at in range(0, d.numel(), 1 << 20)]
    cores = os.cpu_count() or 1
    pieces = [(d.numpy()[at:at + -(-d.numel() // cores)], src.numpy()[at:at + -(-d.numel() // cores)])
              for d, src in zip(dests, sources) for at in range(0, d.numel(), -(-d.numel() // cores))]
    pool = concurrent.futures.ThreadPoolExecutor(cores)
    # the same slices into the very buffers save() copies into (the manager's staging buffers, kept
    # from save to save): two buffers allocated alike copy 3-5 % apart here, by where their pages lie
    staged = asyncs.committer._snapshots._buffers
    into_staged = [(staged[f".model.{name}"].numpy()[at:at + (1 << 20)], src.numpy()[at:at + (1 << 20)])
                   for name, src in state["model"].items() for at in range(0, src.numel(), 1 << 20)]

    def copy_limit() -> float:
        t0 = time.perf_counter()
        for d, src in zip(dests, sources):
            d.copy_(src)
        threaded = time.perf_counter() - t0
        t0 = time.perf_counter()
        for d, src in zip(dests, sources):
            np.copyto(d.numpy(), src.numpy())
        single = time.perf_counter() - t0
        t0 = time.perf_counter()
        list(pool.map(lambda pair: np.copyto(*pair), slices))
        sliced = time.perf_counter() - t0
        t0 = time.perf_counter()
        list(pool.map(lambda pair: np.copyto(*pair), pieces))
        per_core = time.perf_counter() - t0
        return min(threaded, single, sliced, per_core, stolen_slices(slices), stolen_slices(into_staged))

    def stolen_slices(work_slices: list) -> float:
        """The 4 MiB slices taken in turn (a shared counter, no executor's hand-over per slice) by
        this thread and one started before the timed region per other core."""
        turns = itertools.count()  # next() on it is atomic under the GIL
        go = threading.Event()

        def work() -> None:
            for i in turns:
                if i >= len(work_slices):
                    return
                np.copyto(*work_slices[i])

        helpers = [threading.Thread(target=lambda: go.wait() and work()) for _ in range(cores - 1)]
        for thread in helpers:
            thread.start()
        t0 = time.perf_counter()
        go.set()
        work()
        for thread in helpers:
            thread.join()
        return time.perf_counter() - t0

    times = _interleaved({"torch.save": torch_save_upload, "async": default_async, "deferred": deferred_copy,
                          "sync": our_sync, "copy": copy_limit})
    pool.shutdown()
    for mgr in (asyncs, deferred, sync):
        mgr.close()
    best = {k: min(v) for k, v in times.items()}
    mib = sum(t.numel() * t.element_size() for t in state["model"].values()) / 2**20
    base = (f"torch.save + upload {best['torch.save']:.3f} s, our synchronous save {best['sync']:.3f} s, "
            f"{mib:.0f} MiB")
    return [
        _row("stall", "default async save: stall / synchronous save (torch.save + upload)",
             best["async"] / best["torch.save"], f"save() blocked {best['async'] * 1e3:.1f} ms; {base}"),
        _row(None, "default async save: stall / our synchronous save", best["async"] / best["sync"],
             f"save() blocked {best['async'] * 1e3:.1f} ms; {base}"),
        _row("limit", "default async save: copy limit / stall (the stall's floor, same bytes)",
             best["copy"] / best["async"],
             f"a plain copy of the same bytes into pre-faulted buffers {best['copy'] * 1e3:.1f} ms "
             f"({mib * 2**20 / best['copy'] / 1e9:.1f} GB/s; the fastest of torch's threaded copy_, one memcpy per "
             f"tensor, 4 MiB slices handed out or taken in turn (also into save()'s own buffers), and one piece per core of each tensor, over {cores} threads) vs save() "
             f"{best['async'] * 1e3:.1f} ms"),
        _row("deferred", "deferred copy: stall / synchronous save (torch.save + upload)",
             best["deferred"] / best["torch.save"],
             f"save() + wait_for_snapshot() {best['deferred'] * 1e3:.2f} ms behind a "
             f"{min(step_seconds) * 1e3:.0f} ms simulated forward/backward; {base}"),
        _row(None, "deferred copy: stall / our synchronous save", best["deferred"] / best["sync"],
             f"save() + wait_for_snapshot() {best['deferred'] * 1e3:.2f} ms; {base}"),
    ]


# ---------------------------------------------------------------------------- restore, filesystem
def _fs_rows(state: dict, work: Path, threads: int) -> list[dict]:
    root = str(work / "fs-store")
    with CheckpointManager(root, owner="bench", async_save=False) as mgr:
        info = mgr.save(1, state) or mgr.latest()
    files = _files(root, info.key)
    everything = sorted(p for p in open_store(root).path("checkpoints").rglob("*") if p.is_file())
    pieces = rawread.split(rawread.shares([(str(p), p.stat().st_size) for p in files], 1)[0], threads)
    nbytes = sum(p[2] for p in pieces)
    buf = rawread.prefaulted(nbytes)
    target = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}
    rows = []
    for cache in ("warm", "cold"):
        seen: dict[str, list[float]] = {"raw": [], "ours": []}

        def raw(block: int) -> Callable[[], float]:
            def side() -> float:
                seen["raw"].append(rawread.settle(files, cache))
                t0 = time.perf_counter()
                rawread.read_pieces(pieces, threads, buf, block)
                return time.perf_counter() - t0
            return side

        def ours() -> float:
            seen["ours"].append(rawread.settle(everything, cache))
            return _restore_once(root, target, work / f"cache-{time.monotonic_ns()}")

        times = _interleaved({**{f"raw {b >> 10} KiB": raw(b) for b in rawread.BLOCKS}, "ours": ours})
        assert all(torch.equal(target["model"][k], v) for k, v in state["model"].items()), "restore differs"
        r, how = _best_raw(times)
        o = min(times["ours"])
        rows.append(_row("restore", f"restore / limit, fs, page cache {cache}", r / o,
                         f"raw {threads}-thread preadv ({how} blocks) {r:.3f} s ({nbytes / r / 1e9:.2f} GB/s) vs ours {o:.3f} s "
                         f"({nbytes / o / 1e9:.2f} GB/s), {len(files)} files; resident before each read: "
                         f"raw {_fractions(seen['raw'])}, ours {_fractions(seen['ours'])}"))
    return rows


def _best_raw(times: dict[str, list[float]]) -> tuple[float, str]:
    """The fastest raw round of any raw variant, and that variant's name (without "raw ")."""
    name = min((k for k in times if k.startswith("raw")), key=lambda k: min(times[k]))
    return min(times[name]), name.removeprefix("raw ")


def _fractions(values: list[float]) -> str:
    return "/".join(f"{v:.0%}" for v in values)


# ---------------------------------------------------------------------------- restore, S3
def _s3_rows(state: dict, work: Path, in_flight: int) -> list[dict]:
    with bench_s3("S3 row") as server:
        if server is None:
            return []
        objects, nbytes, presigned = save_in_bench_s3(server, state)
        target = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}
        with raw_s3_sides(server, presigned, in_flight) as raw:
            times = _interleaved({**raw, "ours": lambda: _restore_once(BENCH_S3_ROOT, target, work / "s3-cache")})
        assert all(torch.equal(target["model"][k], v) for k, v in state["model"].items()), "restore differs"
        (r, how), o = _best_raw(times), min(times["ours"])
        return [_row("restore", "restore / limit, S3 (moto over HTTP)", r / o,
                     f"raw http.client {how} (presigned by boto3; whole objects, or each as the range of all "
                     f"its bytes as ours asks) of the {len(objects)} objects, {in_flight} in flight, {r:.3f} s "
                     f"({nbytes / r / 1e9:.2f} GB/s) vs ours {o:.3f} s ({nbytes / o / 1e9:.2f} GB/s)")]


BENCH_S3_ROOT = "s3://bench/run"


@contextlib.contextmanager
def bench_s3(rows: str) -> Iterator[Any]:
    """A moto S3 server over HTTP with the bucket ``bench``, this process's environment pointing at it
    while the block runs; None where moto cannot start (the benchmark's S3 ``rows`` are skipped)."""
    try:
        from tests.services import S3Server

        server = S3Server().start()
        server.create_bucket("bench")
    except Exception as err:  # noqa: BLE001 - the S3 rows are skipped where moto cannot start
        _log(f"S3 server unavailable, {rows} skipped: {err}")
        yield None
        return
    saved_env = {k: os.environ.get(k) for k in server.env()}
    os.environ.update(server.env())
    try:
        yield server
    finally:
        server.stop()
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def save_in_bench_s3(server: Any, state: dict) -> tuple[list[tuple[str, int]], int, list[tuple[str, int]]]:
    """``state`` committed as one checkpoint under :data:`BENCH_S3_ROOT`: its objects ``(key, size)``, their
    bytes, and each object's presigned request path (:func:`_presigned`)."""
    with CheckpointManager(BENCH_S3_ROOT, owner="bench", async_save=False) as mgr:
        info = mgr.save(1, state) or mgr.latest()
        store = mgr.store
        objects = [(f"{store.prefix}/{key}", size) for key, size in sorted(store.sizes(info.key).items())]
    return objects, sum(size for _, size in objects), _presigned(server, "bench", objects)



@contextlib.contextmanager
def raw_s3_sides(server: Any, presigned: list[tuple[str, int]],
                 in_flight: int) -> Iterator[dict[str, Callable[[], float]]]:
    """The raw S3 sides of a restore row: ``{"raw whole GETs": ..., "raw ranged GETs": ...}``, each one
    timed read of every presigned object by :class:`rawread.S3Reader`, ``in_flight`` at once; the readers
    closed after the block."""
    readers = {"whole": rawread.S3Reader(server.endpoint, presigned, in_flight),
               "ranged": rawread.S3Reader(server.endpoint, presigned, in_flight, ranged=True)}

    def timed(reader: rawread.S3Reader) -> Callable[[], float]:
        def side() -> float:
            t0 = time.perf_counter()
            reader.read()
            return time.perf_counter() - t0
        return side

    try:
        yield {f"raw {how} GETs": timed(reader) for how, reader in readers.items()}
    finally:
        for reader in readers.values():
            reader.close()


def flag_baseline_bugs(rows: list[dict]) -> list[dict]:
    """``rows``, after saying loudly which of them read faster than their limit (a baseline to fix)."""
    for row in rows:
        if row["verdict"].startswith("BASELINE BUG"):
            _log(f"BASELINE BUG: {row['metric']} = {row['value']:.3f} > 1.0: ours read faster than the limit")
    return rows

def _presigned(server: Any, bucket: str, objects: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """(request path with query-string authentication, size) of each object, signed by boto3 (an S3
    client independent of ours), before the timed region."""
    import boto3
    from urllib.parse import urlsplit

    env = server.env()
    client = boto3.client("s3", endpoint_url=server.endpoint, aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                          aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"], region_name=env["AWS_DEFAULT_REGION"])
    out = []
    for name, size in objects:
        url = urlsplit(client.generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": name},
                                                     ExpiresIn=3600))
        out.append((f"{url.path}?{url.query}", size))
    return out


# ---------------------------------------------------------------------------- restore, FSDP
def _torchrun(nproc: int, *args: str) -> None:
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node", str(nproc),
           "-m", "tests.core.fsdp_worker", *args, "--no-dump"]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        raise RuntimeError(f"torchrun {nproc}: {proc.stderr[-1500:]}")


def raw_ranks(shares: list[list[rawread.Piece]], threads: int, work: Path, block: int = rawread.BLOCK,
              fresh: float = 0.0) -> float:
    """N reader processes (one per share), started and prepared first, then let go together: the
    slowest one's own read time. ``fresh``: the fraction of each one's buffer left untouched until
    the read (else all of it is pre-faulted)."""
    procs = []
    try:
        for i, pieces in enumerate(shares):
            spec = work / f"raw-rank{i}.json"
            spec.write_text(json.dumps({"pieces": pieces, "threads": threads, "block": block, "fresh": fresh}))
            procs.append(subprocess.Popen([sys.executable, "-m", "tests.bench.rawread", str(spec)], cwd=ROOT,
                                          env={**os.environ, "PYTHONPATH": str(ROOT)}, stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, text=True))
        for proc in procs:
            if proc.stdout.readline().strip() != "ready":
                raise RuntimeError("a raw reader process failed to start")
        for proc in procs:
            proc.stdin.write("go\n")
            proc.stdin.flush()
        results = [json.loads(proc.stdout.readline()) for proc in procs]
        for proc in procs:
            if proc.wait(60):
                raise RuntimeError(f"a raw reader process exited {proc.returncode}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return max(r["end"] - r["start"] for r in results)


def _fsdp_rows(total_bytes: int, work: Path, threads: int) -> list[dict]:
    width = max(64, total_bytes // 252)  # Linear(16, w) + Linear(w, 4): 21 w floats, x3 with AdamW
    root = str(work / "fsdp-store")
    _torchrun(2, "--root", root, "--out", str(work / "fsdp-save"), "--steps", "1", "--save-at", "1",
              "--width", str(width))
    with CheckpointManager(root) as mgr:
        key = mgr.latest().key
    files = _files(root, key)
    sized = [(str(p), p.stat().st_size) for p in files]
    nbytes = sum(size for _, size in sized)
    fresh = _optimizer_fraction(root, key)
    rows = []
    for nproc in (2, 4):
        seen: dict[str, list[float]] = {"raw": [], "ours": []}
        ranks: list[list[dict]] = []

        def raw(block: int) -> Callable[[], float]:
            def side() -> float:
                seen["raw"].append(rawread.settle(files, "warm"))
                return raw_ranks(rawread.shares(sized, nproc), threads, work, block)
            return side

        def ours() -> float:
            seen["ours"].append(rawread.settle(files, "warm"))
            out = work / f"fsdp-load-{nproc}-{len(ranks)}"
            _torchrun(nproc, "--root", root, "--out", str(out), "--resume", "--width", str(width))
            ranks.append([json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)])
            return max(r["load_seconds"] for r in ranks[-1])

        def raw_fresh() -> float:
            rawread.settle(files, "warm")
            return raw_ranks(rawread.shares(sized, nproc), threads, work, rawread.BLOCK, fresh)

        times = _interleaved({**{f"raw {b >> 10} KiB": raw(b) for b in rawread.BLOCKS}, "ours": ours,
                              "fresh": raw_fresh})
        (r, how), o = _best_raw(times), min(times["ours"])
        rf = min(times["fresh"])
        best = ranks[times["ours"].index(o)]
        share = nbytes / nproc
        read = [rank["stats"].get("bytes_read", 0) for rank in best]
        rss = max((rank["rss_peak_during_load"] - rank["rss_before_load"]) / rank["share_bytes"] for rank in best)
        rows.append(_row("restore", f"FSDP restore / limit, {nproc} ranks (saved by 2), page cache warm", r / o,
                         f"raw {nproc} processes x {threads} threads ({how} blocks) {r:.3f} s vs our slowest rank "
                         f"{o:.3f} s, "
                         f"{nbytes / 2**20:.0f} MiB in {len(files)} files; resident before each read: "
                         f"raw {_fractions(seen['raw'])}, ours {_fractions(seen['ours'])}"))
        rows.append(_row(None, f"FSDP restore / raw read with the optimizer state's memory fresh, {nproc} ranks",
                         rf / o, f"the same raw read, {fresh:.0%} of each process's buffer (the optimizer state's "
                         f"share, which the load allocates: TrainingState.prepare_load) never touched before the "
                         f"read, {rf:.3f} s (pre-faulted: {r:.3f} s) vs our slowest rank {o:.3f} s"))
        rows.append(_row("bytes", f"FSDP bytes read per rank / its share, {nproc} ranks", max(read) / share,
                         f"read {', '.join(f'{b / 2**20:.1f}' for b in read)} MiB; share {share / 2**20:.1f} MiB "
                         f"(the checkpoint's bytes / {nproc})"))
        rows.append(_row("rss", f"FSDP peak RSS growth during the load / state held, {nproc} ranks", rss,
                         f"state held per rank {best[0]['share_bytes'] / 2**20:.1f} MiB"))
    return rows


def _optimizer_fraction(root: str, key: str) -> float:
    """The fraction of a checkpoint's tensor bytes that are optimizer state (``optimizer.state.*``
    tensors of more than one element: what ``TrainingState.prepare_load`` allocates for the load)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from relaunch.components.core.checkpoint.safe_pickle import load_metadata

    metadata = load_metadata((open_store(root).path(key) / ".metadata").read_bytes())
    total = optim = 0
    for fqn, meta in metadata.state_dict_metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            n = meta.properties.dtype.itemsize
            for size in meta.size:
                n *= size
            total += n
            optim += n if fqn.startswith("optimizer.state.") and len(meta.size) else 0
    return optim / total if total else 0.0


def size_mib(quick: bool) -> int:
    """The state size of this run: BENCH_CHECKPOINT_MIB (``--size-mib``), else 1024 (64 quick)."""
    return int(os.environ.get("BENCH_CHECKPOINT_MIB") or (64 if quick else 1024))


def run(quick: bool) -> list[dict]:
    """Rows of the benchmark table (see the module docstring)."""
    mib = size_mib(quick)
    io_threads, in_flight = our_concurrency()
    work = Path(tempfile.mkdtemp(prefix="bench-ckpt-", dir=os.environ.get("BENCH_CHECKPOINT_DIR")))
    rows: list[dict] = []
    try:
        state = _state(mib << 20)
        _log(f"{mib} MiB; our reader: {io_threads} threads (fs), {in_flight} GETs in flight (S3)")
        _log("save stall: default async, deferred copy, synchronous")
        rows += _stall_rows(state, work)
        _log("restore on the filesystem, page cache warm and cold")
        rows += _fs_rows(state, work, io_threads)
        _log("restore on S3 (moto over HTTP)")
        rows += _s3_rows(state, work, in_flight)
        del state
        _log("FSDP2 restore on 2 and 4 ranks (torchrun)")
        rows += _fsdp_rows(mib << 20, work, io_threads)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return flag_baseline_bugs(rows)
