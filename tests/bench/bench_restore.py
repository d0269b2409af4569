"""Restore of a training state (model + AdamW after a step) against this machine's limit for the same work.

    python -m tests.bench restore [--size-mib N]        # make bench ARGS="restore --size-mib N"

Size: the whole state (parameters and AdamW's two moments: 3x the parameters), ``--size-mib`` or
``BENCH_CHECKPOINT_MIB`` (default 1024; 64 with --quick); ``BENCH_RESTORE_S3_MIB`` sets the S3 rows'
apart (default the same). The model is ``Linear(1024, 1024)`` layers (4 MiB tensors, 3 per layer).
Every ratio is (raw time) / (our time) for the same bytes; the raw side runs none of relaunch's code.

- **Resume into a fresh model and optimizer** (goal >= 0.9): as a restarted training does, a new
  process builds the model (its parameters initialised, so written) and AdamW (no state yet), then
  loads the latest checkpoint (timed: locate, manifest, metadata, planning, the optimizer state
  allocated, reads, every chunk digest checked; the imports the load needs are made before). The
  limit: a new process that imports torch, allocates the parameters' share of the bytes with the same
  allocator (``torch.empty``) and writes it, then, timed, allocates the optimizer's share as tensors
  of the same sizes (``torch.empty``, never touched: what ``TrainingState.prepare_load`` gives the
  load) and reads every byte of the checkpoint into the two. Memory as fresh on both sides: each of
  its pages faults once during the read.
- **Restore into memory already held** (goal >= 0.8): the same load, in this process, into a model
  and optimizer that exist and were stepped (every page touched), against a raw read of the same
  bytes into buffers page-faulted before the timed region.

Raw reads (tests/bench/rawread.py) use our reader's concurrency: on a filesystem as many threads as
ours, each reading one piece front to back with ``os.preadv`` in 512 KiB and in 8 MiB blocks (the
faster is the limit); on S3 (moto over HTTP) plain ``http.client`` GETs presigned by boto3, as many in
flight as ours, whole objects and, as a second variant, each as the range of all its bytes. Page cache:
every file of the checkpoint resident before each side, checked with ``mincore`` and printed (moto
holds its objects in its own process). Sides interleaved (each raw variant followed by a run of ours,
so both sides have as many samples), best of ROUNDS rounds, each side after an ``os.sync()``. Each row
shows the 1-minute load average before and after it was measured (the machine is shared). Every
restore is checked bitwise against the saved state. A ratio above 1.0 means the baseline is not the
limit: the row says so. Both filesystem rows have a measured companion: the same raw read with each
block hashed by XXH3-128 as it arrives (the integrity check every restore of ours makes).
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from relaunch.components.core.checkpoint import CheckpointManager
from relaunch.components.core.store import open_store
from tests.bench import rawread
from tests.bench.bench_checkpoint import (BENCH_S3_ROOT, _best_raw, _files, _fractions, _interleaved, _restore_once,
                                          bench_s3, flag_baseline_bugs, our_concurrency, raw_s3_sides, save_in_bench_s3,
                                          size_mib)

ROOT = Path(__file__).resolve().parents[2]
ROUNDS = 5
WIDTH = 1024
GOALS = {"fresh": 0.9, "held": 0.8}


def _log(msg: str) -> None:
    print(f"  bench_restore: {msg}", file=sys.stderr, flush=True)


def build_training(mib: int, *, stepped: bool, seed: int = 0):
    """A TrainingState of ``Linear(WIDTH, WIDTH)`` layers whose parameters and AdamW moments come to
    about ``mib`` MiB; ``stepped``: AdamW took one step (its state exists), else it has none."""
    from relaunch.components.core.trainer.state import TrainingState

    torch.manual_seed(seed)
    layers = max(1, round((mib << 20) / 3 / (WIDTH * WIDTH * 4)))
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if stepped:
        model(torch.randn(4, WIDTH)).sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return TrainingState(model, optimizer)


def state_digest(state: Any) -> str:
    """XXH3-128 of every parameter's bytes and of its optimizer state (keys in order), and the step."""
    import xxhash

    h = xxhash.xxh3_128()
    for param in state.model.parameters():
        h.update(param.detach().contiguous().view(torch.uint8).reshape(-1).numpy())
        for key, value in sorted(state.optimizer.state.get(param, {}).items()):
            h.update(key.encode())
            h.update(value.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
    h.update(str(state.step).encode())
    return h.hexdigest()


def _shapes(state: Any) -> tuple[list[int], list[int]]:
    """(bytes of each parameter, bytes of each optimizer state tensor of a parameter's size)."""
    params = [p.numel() * p.element_size() for p in state.model.parameters()]
    moments = [v.numel() * v.element_size() for p in state.model.parameters()
               for v in state.optimizer.state.get(p, {}).values() if v.dim()]
    return params, moments


def _load_average() -> float:
    return os.getloadavg()[0]


def _row(kind: str | None, metric: str, value: float, detail: str) -> dict[str, Any]:
    if kind is None:
        return {"metric": metric, "value": value, "goal": "measured", "verdict": "", "detail": detail}
    goal = GOALS[kind]
    verdict = "meets" if value >= goal else "MISSES"
    if value > 1.0:
        verdict = "BASELINE BUG: ours beat the limit"
    return {"metric": metric, "value": value, "goal": f">= {goal:g}", "verdict": verdict, "detail": detail}


# ---------------------------------------------------------------------------- the two new processes
def _child(role: str, spec_path: str) -> None:
    """One side of a fresh resume, in a process of its own (see the module doc); prints its result
    as one JSON line."""
    spec = json.loads(Path(spec_path).read_text())
    if role == "ours":
        for module in ("torch.distributed.checkpoint", "torch.distributed.checkpoint.state_dict",
                       "relaunch.components.core.checkpoint.dcp_io", "relaunch.components.core.checkpoint.safe_pickle"):
            importlib.import_module(module)  # imports are a process start's cost (measured apart), not the load's
        state = build_training(spec["mib"], stepped=False, seed=1)  # initialised apart from the saved one
        with CheckpointManager(spec["root"], cache_dir=spec["cache"]) as reader:
            t0 = time.perf_counter()
            reader.load(state)
            seconds = time.perf_counter() - t0
        print(json.dumps({"seconds": seconds, "digest": state_digest(state)}), flush=True)
        return
    touched = [torch.empty(n, dtype=torch.uint8).fill_(0x5A) for n in spec["touched"]]  # the built model
    reader = None
    if spec["kind"] == "s3":
        reader = rawread.S3Reader(spec["endpoint"], [tuple(o) for o in spec["objects"]], spec["threads"],
                                  ranged=spec["ranged"], buffer=False)
    t0 = time.perf_counter()
    fresh = [torch.empty(n, dtype=torch.uint8) for n in spec["fresh"]]  # as prepare_load allocates
    into = [t.numpy() for t in touched + fresh]
    if reader is None:
        rawread.read_pieces([tuple(p) for p in spec["pieces"]], spec["threads"], into, spec["block"],
                            hashed=spec.get("hashed", False))
    else:
        reader.read(into)
    seconds = time.perf_counter() - t0
    if reader is not None:
        reader.close()
    print(json.dumps({"seconds": seconds}), flush=True)


def _spawn(role: str, spec: dict, work: Path) -> dict:
    path = work / f"{role}-spec.json"
    path.write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, "-m", "tests.bench.bench_restore", role, str(path)], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=900)
    if proc.returncode:
        raise RuntimeError(f"{role} process exited {proc.returncode}: {proc.stderr[-1500:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _alternated(raws: dict[str, Callable[[], float]], ours: Callable[[], float]) -> dict[str, Callable[[], float]]:
    """Each raw variant followed by a run of ours: as many samples of ours as of the raw side, whose
    best is the limit (a new process's page faults swing 2x here from run to run)."""
    sides: dict[str, Callable[[], float]] = {}
    for i, (name, side) in enumerate(raws.items()):
        sides[name], sides[f"ours {i}"] = side, ours
    return sides


def _best_ours(times: dict[str, list[float]]) -> float:
    return min(min(v) for k, v in times.items() if k.startswith("ours"))


def _fresh_layout(nbytes: int, params: list[int], moments: list[int]) -> tuple[list[int], list[int]]:
    """(pre-touched buffer sizes, fresh buffer sizes) of a raw read of ``nbytes``: the parameters and
    the rest of the files (archive records, small items) touched, the optimizer's moments fresh."""
    rest = nbytes - sum(params) - sum(moments)
    if rest < 0:
        raise RuntimeError(f"the checkpoint holds {nbytes} bytes, fewer than its tensors' {sum(params) + sum(moments)}")
    return params + ([rest] if rest else []), moments


# ---------------------------------------------------------------------------- filesystem
def _fs_rows(mib: int, work: Path, threads: int) -> list[dict]:
    root = str(work / "fs-store")
    saved = build_training(mib, stepped=True)
    params, moments = _shapes(saved)
    expected = state_digest(saved)
    with CheckpointManager(root, owner="bench", async_save=False) as mgr:
        info = mgr.save(1, saved) or mgr.latest()
    del saved
    files = _files(root, info.key)
    everything = sorted(p for p in open_store(root).path("checkpoints").rglob("*") if p.is_file())
    pieces = rawread.split(rawread.shares([(str(p), p.stat().st_size) for p in files], 1)[0], threads)
    nbytes = sum(p[2] for p in pieces)
    touched, fresh = _fresh_layout(nbytes, params, moments)
    rows = []

    # resume into a fresh model and optimizer: both sides a new process
    seen: dict[str, list[float]] = {"raw": [], "ours": []}
    digests: list[str] = []

    def raw_fresh(block: int, hashed: bool = False) -> Callable[[], float]:
        def side() -> float:
            seen["raw"].append(rawread.settle(files, "warm"))
            return _spawn("raw", {"kind": "fs", "pieces": pieces, "threads": threads, "block": block,
                                  "touched": touched, "fresh": fresh, "hashed": hashed}, work)["seconds"]
        return side

    def ours_fresh() -> float:
        seen["ours"].append(rawread.settle(everything, "warm"))
        out = _spawn("ours", {"root": root, "mib": mib, "cache": str(work / "cache-fresh")}, work)
        digests.append(out["digest"])
        return out["seconds"]

    before = _load_average()
    checked_block = max(rawread.BLOCKS)  # the faster block size here; one variant keeps the bench's time
    times = _interleaved(_alternated({**{f"raw {b >> 10} KiB": raw_fresh(b) for b in rawread.BLOCKS},
                                      f"checked {checked_block >> 10} KiB": raw_fresh(checked_block, hashed=True)},
                                     ours_fresh))
    load = f"load {before:.2f}->{_load_average():.2f}"
    if set(digests) != {expected}:
        raise AssertionError("a resume into a fresh model and optimizer is not bitwise the saved state")
    (r, how), o = _best_raw(times), _best_ours(times)
    checked = min(min(v) for k, v in times.items() if k.startswith("checked"))
    rows.append(_row("fresh", "resume into a fresh model+optimizer / raw read into equally fresh memory, fs", r / o,
                     f"raw {threads}-thread preadv ({how} blocks) {r:.3f} s ({nbytes / r / 1e9:.2f} GB/s) vs ours "
                     f"{o:.3f} s ({nbytes / o / 1e9:.2f} GB/s); {sum(fresh) / nbytes:.0%} of the bytes into memory "
                     f"allocated fresh; {nbytes / 2**20:.0f} MiB, {len(files)} files; resident before each read: "
                     f"raw {_fractions(seen['raw'])}, ours {_fractions(seen['ours'])}; {load}"))
    rows.append(_row(None, "resume into a fresh model+optimizer / raw read + XXH3-128 of every block, fs", checked / o,
                     f"the same raw read into equally fresh memory with each block hashed right after it is read "
                     f"(the check ours makes) {checked:.3f} s vs ours {o:.3f} s; the raw read alone {r:.3f} s: the "
                     f"check's share of the limit {1 - r / checked:.0%}"
                     + ("; ours is faster: it populates the optimizer's fresh pages on a thread while it plans, "
                        "before its first read" if checked > o else "")))

    # restore into memory already held: this process, touched model and optimizer, pre-faulted buffers
    held = build_training(mib, stepped=True, seed=1)
    buf = rawread.prefaulted(nbytes)
    seen = {"raw": [], "ours": []}

    def raw_held(block: int, hashed: bool = False) -> Callable[[], float]:
        def side() -> float:
            seen["raw"].append(rawread.settle(files, "warm"))
            t0 = time.perf_counter()
            rawread.read_pieces(pieces, threads, buf, block, hashed=hashed)
            return time.perf_counter() - t0
        return side

    def ours_held() -> float:
        seen["ours"].append(rawread.settle(everything, "warm"))
        return _restore_once(root, held, work / f"cache-{time.monotonic_ns()}")

    before = _load_average()
    times = _interleaved(_alternated({**{f"raw {b >> 10} KiB": raw_held(b) for b in rawread.BLOCKS},
                                      **{f"checked {b >> 10} KiB": raw_held(b, hashed=True) for b in rawread.BLOCKS}},
                                     ours_held))
    load = f"load {before:.2f}->{_load_average():.2f}"
    if state_digest(held) != expected:
        raise AssertionError("a restore into a held model and optimizer is not bitwise the saved state")
    (r, how), o = _best_raw(times), _best_ours(times)
    checked = min(min(v) for k, v in times.items() if k.startswith("checked"))
    rows.append(_row("held", "restore into a held model+optimizer / raw read into pre-touched buffers, fs", r / o,
                     f"raw {threads}-thread preadv ({how} blocks) {r:.3f} s ({nbytes / r / 1e9:.2f} GB/s) vs ours "
                     f"{o:.3f} s ({nbytes / o / 1e9:.2f} GB/s); resident before each read: raw "
                     f"{_fractions(seen['raw'])}, ours {_fractions(seen['ours'])}; {load}"))
    rows.append(_row(None, "restore into a held model+optimizer / raw read + XXH3-128 of every block, fs", checked / o,
                     f"the same raw read with each block hashed right after it is read (the check ours makes, "
                     f"same library; it releases the GIL, so what it costs is the cores' time) {checked:.3f} s vs ours {o:.3f} s; the raw read alone "
                     f"{r:.3f} s: the check's share of the limit {1 - r / checked:.0%}"))
    return rows


# ---------------------------------------------------------------------------- S3 (moto over HTTP)
def _s3_rows(mib: int, work: Path, in_flight: int) -> list[dict]:
    with bench_s3("S3 rows") as server:
        if server is None:
            return []
        root = BENCH_S3_ROOT
        saved = build_training(mib, stepped=True)
        params, moments = _shapes(saved)
        expected = state_digest(saved)
        objects, nbytes, presigned = save_in_bench_s3(server, saved)
        del saved
        touched, fresh = _fresh_layout(nbytes, params, moments)
        rows = []
        digests: list[str] = []

        def raw_fresh(ranged: bool) -> Callable[[], float]:
            return lambda: _spawn("raw", {"kind": "s3", "endpoint": server.endpoint, "objects": presigned,
                                          "threads": in_flight, "ranged": ranged, "touched": touched,
                                          "fresh": fresh}, work)["seconds"]

        def ours_fresh() -> float:
            out = _spawn("ours", {"root": root, "mib": mib, "cache": str(work / "s3-cache")}, work)
            digests.append(out["digest"])
            return out["seconds"]

        before = _load_average()
        times = _interleaved(_alternated({"raw whole GETs": raw_fresh(False), "raw ranged GETs": raw_fresh(True)},
                                         ours_fresh))
        load = f"load {before:.2f}->{_load_average():.2f}"
        if set(digests) != {expected}:
            raise AssertionError("a resume from S3 into a fresh model and optimizer is not bitwise the saved state")
        (r, how), o = _best_raw(times), _best_ours(times)
        rows.append(_row("fresh", "resume into a fresh model+optimizer / raw read into equally fresh memory, S3 "
                         "(moto)", r / o,
                         f"raw http.client {how} of the {len(objects)} objects, {in_flight} in flight, {r:.3f} s "
                         f"({nbytes / r / 1e9:.2f} GB/s) vs ours {o:.3f} s ({nbytes / o / 1e9:.2f} GB/s); "
                         f"{sum(fresh) / nbytes:.0%} of the bytes into memory allocated fresh; {load}"))

        held = build_training(mib, stepped=True, seed=1)
        before = _load_average()
        with raw_s3_sides(server, presigned, in_flight) as raw:
            times = _interleaved(_alternated(raw, lambda: _restore_once(root, held, work / "s3-cache")))
        load = f"load {before:.2f}->{_load_average():.2f}"
        if state_digest(held) != expected:
            raise AssertionError("a restore from S3 into a held model and optimizer is not bitwise the saved state")
        (r, how), o = _best_raw(times), _best_ours(times)
        rows.append(_row("held", "restore into a held model+optimizer / raw read into pre-touched buffers, S3 (moto)",
                         r / o, f"raw http.client {how} of the {len(objects)} objects, {in_flight} in flight, "
                         f"{r:.3f} s ({nbytes / r / 1e9:.2f} GB/s) vs ours {o:.3f} s ({nbytes / o / 1e9:.2f} GB/s); "
                         f"{load}"))
        return rows


def run(quick: bool) -> list[dict]:
    """Rows of the benchmark table (see the module docstring)."""
    mib = size_mib(quick)
    s3_mib = int(os.environ.get("BENCH_RESTORE_S3_MIB") or mib)
    threads, in_flight = our_concurrency()
    work = Path(tempfile.mkdtemp(prefix="bench-restore-", dir=os.environ.get("BENCH_CHECKPOINT_DIR")))
    rows: list[dict] = []
    try:
        _log(f"{mib} MiB of model + AdamW state (S3: {s3_mib} MiB); our reader: {threads} threads (fs), "
             f"{in_flight} GETs in flight (S3)")
        _log("filesystem: resume into a fresh model and optimizer, restore into held ones")
        rows += _fs_rows(mib, work, threads)
        _log("S3 (moto over HTTP): the same")
        rows += _s3_rows(s3_mib, work, in_flight)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return flag_baseline_bugs(rows)


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2])
