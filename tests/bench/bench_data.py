"""The data path (issue 41): the streamed loader, a rank's memory, prepare and a resume's loader, against their limits.

    python -m tests.bench data          # make bench ARGS=data; about 2-3 minutes on 2 cores
    BENCH_DATA_ROWS=prepare make bench ARGS=data    # only the prepare rows (seconds); names: prepare,
                                                    # steps, memory, resume (prepare always runs)

Every row is measured side by side in this one run; the sides of a timed row are interleaved, and
the page cache state of the files each side reads is brought about and checked (``mincore``) before it.

- **The loader keeps up** (goal <= 1.05): the LM's training step (configs/lm.yaml's model, AdamW, its
  two micro-batches of 8 and clipping; forward, backward and the optimizer's step on one process, as the
  trainer makes them) with its batches from :class:`ShardLoader` (one loader worker, the shards in a
  filesystem store, resident) over the same step with the same batches already in memory (copied out of
  the loader before timing): the limit. One streamed pass starts half its steps before a window
  boundary of the global order (the next window's shards are fetched mid-pass); each round runs a block
  of ``BLOCK`` steps of each side over the same steps' batches, the order of the two sides alternated
  round by round; the figure is the ratio of the median steps (the mins and the means beside it). The
  pass's first batch (the resume's, the last row's) is taken before the timed region. A new process
  with ``OMP_NUM_THREADS=1``, as the local launcher runs a rank. The corpus: the whole standard
  library (~11 MB, six shards), committed by the prepare row.
- **Memory independent of the corpus** (goal < 200 MB): the peak RSS of a rank (the training process
  and its loader worker: the sum of each one's ``VmHWM``, read before the pass ends) training ``MEMORY_STEPS``
  steps across a window boundary, over ~2 GB of committed shards against ~20 MB (synthetic token rows of
  the LM's shape written by :class:`DatasetWriter` on a real disk, deleted at the end; scaled down to
  what the disk holds with a margin, and said so).
- **prepare against the tokenizer** (goal >= 0.5): bytes of corpus per second of the LM task's
  ``build_dataset()`` committed by ``commit_source`` into a new filesystem store, over ``encode`` alone
  on the same files: both read the files from disk (page cache warm for both). Beside it, not sides
  of the ratio, prepare's parts alone: the listing and the read and hash of every file (nothing cut
  or written), and the disk writing and fsyncing the same shards' bytes one after another (a file
  each, then their folder): prepare overlaps them, so it takes at least the longer of the two. And
  the objects a second prepare of the same corpus writes (goal 0).
- **The loader's position** (goal <= 50 ms): ``loader.batches(step)`` to the first batch in hand
  (worker started, shards fetched and checked) for a mid-epoch step of the 2 GB dataset, less the same
  for step 0; and the position restore alone (the sampler at the step and its first indices, the worker
  started), absolute. In a process holding the LM's model and optimizer after a step, as a resumed rank.

A ratio whose baseline is the limit that ours beats (prepare above 1.0; the streamed step below
1 / 1.05 of the step from memory) says BASELINE BUG.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from tests.bench import rawread

ROOT = Path(__file__).resolve().parents[2]
LM_CONFIG = ROOT / "configs" / "lm.yaml"
BLOCK = 4  # steps per side per round of the step-time row: short blocks pair the sides in the host's load
ROUNDS = 24
MEMORY_STEPS = 32  # a rank's steps in the memory row: half before a window boundary, half after
PREPARE_ROUNDS = 3
RESUME_ROUNDS = 15
BIG_BYTES = 2_000_000_000
SMALL_BYTES = 20_000_000
GOALS = {"keeps_up": 1.05, "rss_mb": 200.0, "prepare": 0.5, "position_ms": 50.0}
ROW_GROUPS = ("steps", "memory", "prepare", "resume")  # in the table's order


def _log(msg: str) -> None:
    print(f"  bench_data: {msg}", file=sys.stderr, flush=True)


def _row(metric: str, value: float, goal: str, ok: bool | None, baseline: str, detail: str,
         bug: bool = False) -> dict[str, Any]:
    verdict = "BASELINE BUG: ours beat the limit" if bug else "" if ok is None else "meets" if ok else "MISSES"
    return {"metric": metric, "value": value, "goal": goal, "verdict": verdict, "baseline": baseline,
            "detail": detail}


def _load() -> str:
    return f"{os.getloadavg()[0]:.2f}"


# ---------------------------------------------------------------------------- parts (tested)
def vm_hwm(pid: int) -> int:
    """The peak resident set of process ``pid`` in bytes (``VmHWM`` of ``/proc/<pid>/status``; 0 when
    it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def peak_rss_tree(pid: int | None = None) -> dict[int, int]:
    """``{pid: peak RSS in bytes}`` of process ``pid`` (this one by default) and every process under
    it (a rank: its training process and its loader workers); their sum is the rank's peak."""
    import psutil

    pid = os.getpid() if pid is None else pid
    pids = [pid] + [child.pid for child in psutil.Process(pid).children(recursive=True)]
    return {p: vm_hwm(p) for p in pids}


def rows_wanted(names: str) -> set[str]:
    """The row groups ``BENCH_DATA_ROWS`` names (comma-separated; empty: all), prepare always among them
    (the step row trains on its dataset).

    Raises:
        ValueError: a name that is not a row group.
    """
    wanted = {n.strip() for n in names.split(",") if n.strip()} or set(ROW_GROUPS)
    unknown = wanted - set(ROW_GROUPS)
    if unknown:
        raise ValueError(f"BENCH_DATA_ROWS={names!r}: no row group {', '.join(sorted(unknown))}; "
                         f"name some of {', '.join(ROW_GROUPS)}")
    return wanted | {"prepare"}


def fit_to_disk(want: int, free: int, margin: int) -> int:
    """The largest dataset size up to ``want`` bytes that leaves ``margin`` of ``free`` bytes (0: none)."""
    return max(0, min(want, free - margin))


def disk_margin(free: int) -> int:
    """What the bench leaves free on the disk: 2 GiB or a tenth of what is free, the larger."""
    return max(2 << 30, free // 10)


def fstype(path: str | os.PathLike) -> str:
    """The filesystem type of the mount holding ``path`` (``/proc/mounts``; "" when unknown)."""
    path = os.path.realpath(path)
    best = ("", "")
    try:
        lines = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return ""
    for line in lines:
        mount, kind = line.split()[1:3]
        if (path == mount or path.startswith(mount.rstrip("/") + "/")) and len(mount) >= len(best[0]):
            best = (mount, kind)
    return best[1]


def work_dir() -> Path:
    """A new folder on a real disk (``BENCH_DATA_DIR``, else the temp dir, else /var/tmp): a dataset
    on tmpfs would be memory, and its pages could not be cold or counted apart."""
    for base in [os.environ.get("BENCH_DATA_DIR"), tempfile.gettempdir(), "/var/tmp"]:
        if base and os.path.isdir(base) and fstype(base) not in ("tmpfs", "ramfs"):
            return Path(tempfile.mkdtemp(prefix="bench-data-", dir=base))
    raise RuntimeError("no folder on a real disk for the datasets: set BENCH_DATA_DIR to one (not tmpfs)")


def write_synthetic(store, nbytes: int, seq_len: int = 128, seed: int = 0,
                    shard_bytes: int | None = None) -> tuple[Any, int]:
    """A committed dataset of about ``nbytes`` of LM token rows (``tokens``: ``[seq_len + 1]`` of the byte
    tokenizer's dtype, each below its vocabulary) in one ``train`` split, cut into shards of
    ``shard_bytes`` (the store's default): (its manifest, the objects written). Every shard's content
    differs (its first two tokens count the shards), so none is shared by content address."""
    from relaunch.components.core.data.shards import SHARD_BYTES, DatasetWriter
    from relaunch.components.tasks.lm import BYTES, VOCAB_SIZE

    shard_bytes = shard_bytes or SHARD_BYTES
    width = seq_len + 1
    row = width * BYTES.dtype.itemsize
    total = max(1, nbytes // row)
    per_shard = max(1, shard_bytes // row)  # the writer cuts a shard every per_shard rows
    base = np.random.default_rng(seed).integers(0, VOCAB_SIZE, size=(per_shard, width), dtype=BYTES.dtype)
    writer = DatasetWriter(store, meta={"tokenizer": BYTES.describe(), "seq_len": seq_len, "synthetic": {"seed": seed}},
                           shard_bytes=shard_bytes)
    done = k = 0
    while done < total:
        n = min(per_shard, total - done)
        chunk = base[:n].copy()
        chunk[:, 0], chunk[:, 1] = k % VOCAB_SIZE, (k // VOCAB_SIZE) % VOCAB_SIZE
        writer.add("train", {"tokens": chunk})
        done, k = done + n, k + 1
    manifest = writer.commit()
    return manifest, writer.written


def window_boundary(shard_samples: list[int], seed: int, global_batch: int) -> int:
    """The first step of epoch 0 whose first sample is in the global order's second window (the step a
    loader first fetches new shards at, after its start), from the order's public function."""
    from relaunch.components.core.data.order import WINDOW_SHARDS, GlobalOrder

    if len(shard_samples) <= WINDOW_SHARDS:
        raise ValueError(f"{len(shard_samples)} shards fill one window: no boundary")
    order = GlobalOrder(list(shard_samples), seed)
    starts = np.concatenate([[0], np.cumsum(shard_samples)[:-1]])
    first_window = sum(sorted(shard_samples, reverse=True)[:WINDOW_SHARDS])  # an upper bound of its samples
    positions = np.arange(min(order.total, 2 * first_window))  # window 0 whole and the start of window 1
    shards = np.searchsorted(starts, order.indices(0, positions), side="right") - 1
    first_seen = np.unique(shards, return_index=True)[1]  # the position each shard appears first at
    position = int(np.sort(first_seen)[WINDOW_SHARDS])  # the fifth shard: the next window begins
    return position // global_batch


def shards_of_steps(manifest, seed: int, global_batch: int, steps: list[int]) -> list[int]:
    """The indices (in manifest order) of the train shards that ``steps`` of a one-rank training read."""
    from relaunch.components.core.data.order import GlobalOrder, rank_positions

    counts = [s.samples for s in manifest.split("train")]
    order = GlobalOrder(counts, seed)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    spe = sum(counts) // global_batch
    seen: set[int] = set()
    for step in steps:
        epoch, within = divmod(step, spe)
        index = order.indices(epoch, rank_positions(within, global_batch, 0, 1))
        seen.update((np.searchsorted(starts, index, side="right") - 1).tolist())
    return sorted(seen)


def shard_files(root: str, manifest, which: list[int] | None = None) -> list[str]:
    """The files of the train shards (all, or those at the indices ``which``) of a filesystem store."""
    from relaunch.components.core.store import open_store

    store = open_store(root)
    shards = manifest.split("train")
    return [str(store.path(shards[i].key)) for i in (range(len(shards)) if which is None else which)]


def disk_write(payloads: list[bytes], folder: Path) -> float:
    """Seconds to write each of ``payloads`` to a new file in ``folder`` (created) and fsync it, then
    fsync the folder: what making those bytes durable costs on this disk, with nothing else."""
    folder.mkdir(parents=True)
    t0 = time.perf_counter()
    for i, payload in enumerate(payloads):
        fd = os.open(folder / f"{i}.bin", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(payload)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------- a rank, in a process of its own
def lm_config(store_uri: str, overrides: list[str] = ()):
    """configs/lm.yaml on the store ``store_uri``, steps enough for any start step."""
    from relaunch.components.core.contract.config_loading import load_config

    return load_config(LM_CONFIG, [f"store.uri={store_uri}", "train.max_steps=1000000000", *overrides])


class Rank:
    """One rank of the LM's training as the trainer builds it (world size 1): its loader over the
    committed ``version``, the model, AdamW, the schedule, and one training step."""

    def __init__(self, store_uri: str, version: str):
        import torch

        from relaunch.components.core.data import open_training_data
        from relaunch.components.core.store import open_store
        from relaunch.components.core.trainer import setup
        from relaunch.components.tasks.lm import make_task

        self.config = lm_config(store_uri, [f"data.version={version}"])  # the task reads its tokenizer there
        self.task = make_task(self.config)
        self.data = open_training_data(self.config, self.task, open_store(store_uri), version, 0, 1)
        self.device = torch.device("cpu")
        self.parts = setup.build_model(self.config, self.task, self.device, self.data.total_steps, None)
        self.setup = setup

    def step(self, batch: dict) -> float:
        """Forward, backward (two micro-batches), clipping and the optimizer's step, as the trainer."""
        from relaunch.components.core.trainer.parallel import total_grad_norm

        t, p = self.config.train, self.parts
        batch = self.setup.to_device(batch, self.device)
        micro = self.setup.micro_batches(batch, t.grad_accum_steps)
        total = 0.0
        for part in micro:
            loss = self.task.loss(p.model, part) / len(micro)
            loss.backward()
            total += float(loss.detach())
        total_grad_norm(p.module, t.grad_clip_norm)
        p.optimizer_step()
        return total


def _steps_child(spec: dict) -> dict:
    """Row 1's two sides in rounds over one streamed pass: a block of steps from memory and the same
    steps' block streamed, the order of the two alternated each round."""
    rank = Rank(spec["uri"], spec["version"])
    loader, start, block, rounds = rank.data.loader, spec["start"], spec["block"], spec["rounds"]
    batches = loader.batches(start)
    next(batches)  # the pass's first batch: the resume's (row 4), not a step's
    held = [{k: v.clone() for k, v in next(batches).items()} for _ in range(block * rounds)]  # out of shared memory
    loader.close()
    for batch in held[:2]:  # warm-up: the first steps allocate the optimizer's state and the autograd's buffers
        rank.step(batch)
    resident = rawread.settle(spec["files"], "warm")
    memory: list[float] = []
    streamed: list[float] = []
    batches = loader.batches(start)
    next(batches)
    for r in range(rounds):
        steps = range(r * block, (r + 1) * block)
        for side in (("memory", "streamed") if r % 2 == 0 else ("streamed", "memory")):
            for i in steps:
                t0 = time.perf_counter()
                batch = held[i] if side == "memory" else next(batches)
                rank.step(batch)
                (memory if side == "memory" else streamed).append(time.perf_counter() - t0)
                if side == "streamed" and not bool((batch["tokens"] == held[i]["tokens"]).all()):
                    raise AssertionError(f"the streamed batch of step {start + 1 + i} is not the one held in memory")
    loader.close()
    return {"memory": memory, "streamed": streamed, "resident": resident}


def _memory_child(spec: dict) -> dict:
    """Row 2, one corpus: the rank's peak RSS (process and loader worker) over ``steps`` trained steps."""
    rank = Rank(spec["uri"], spec["version"])
    before = vm_hwm(os.getpid())
    counts = [s.samples for s in rank.data.loader.dataset.shards]
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    batches = rank.data.loader.batches(spec["start"])
    seen: set[int] = set()
    for _ in range(spec["steps"]):
        batch = next(batches)
        seen.update((np.searchsorted(starts, batch["index"].numpy(), side="right") - 1).tolist())
        rank.step(batch)
    peaks = peak_rss_tree()  # the worker is alive until the pass closes
    rank.data.loader.close()
    return {"peaks": {str(k): v for k, v in peaks.items()}, "main": os.getpid(), "before_loader": before,
            "shards_read": len(seen), "shards": len(counts)}


def _position_parts(loader, step: int) -> tuple[float, float]:
    """(the sampler at ``step`` and its first batch of indices, the loader's worker started with its
    first indices queued), in seconds: what ``loader.batches(step)`` does before a shard is fetched,
    rebuilt here from the loader's public parts (the same sampler and DataLoader arguments)."""
    import torch

    from relaunch.components.core.data.loader import StepBatches

    t0 = time.perf_counter()
    sampler = StepBatches(loader.order, loader.spe, loader.total, loader.g, loader.rank, loader.world, step)
    next(iter(sampler))
    t1 = time.perf_counter()
    dl = torch.utils.data.DataLoader(loader.dataset, batch_sampler=sampler, num_workers=loader.num_workers,
                                     collate_fn=lambda batch: batch, prefetch_factor=loader.prefetch,
                                     generator=torch.Generator().manual_seed(loader.seed), persistent_workers=False)
    iterator = iter(dl)
    t2 = time.perf_counter()
    next(iterator)
    del iterator
    return t1 - t0, t2 - t0


def _resume_child(spec: dict) -> dict:
    """Row 4: ``batches(step)`` to the first batch for step 0 and a mid-epoch step, alternated, in a
    process that holds the LM's model and optimizer after a step."""
    rank = Rank(spec["uri"], spec["version"])
    loader = rank.data.loader
    import torch

    from relaunch.components.tasks.lm import VOCAB_SIZE

    # the optimizer's state exists, as a resumed rank's (tokens made here: a batch read in this process
    # would leave its shards in the dataset's cache, which a forked worker inherits)
    width = rank.task.o["seq_len"] + 1
    rank.step({"tokens": torch.randint(0, VOCAB_SIZE, (rank.data.global_batch_size, width), dtype=torch.int64)})
    out: dict[str, Any] = {"first": {"0": [], "mid": []}, "sampler": {"0": [], "mid": []},
                           "started": {"0": [], "mid": []}, "resident": []}
    for r in range(spec["rounds"]):
        for name in (("0", "mid") if r % 2 == 0 else ("mid", "0")):
            step = 0 if name == "0" else spec["mid"]
            out["resident"].append(rawread.settle(spec["files"], "warm"))
            t0 = time.perf_counter()
            batches = loader.batches(step)
            batch = next(batches)
            out["first"][name].append(time.perf_counter() - t0)
            loader.close()
            if int(batch["step"]) != step:
                raise AssertionError(f"the loader started at step {int(batch['step'])}, not {step}")
            sampler, started = _position_parts(loader, step)
            out["sampler"][name].append(sampler)
            out["started"][name].append(started)
    return out


CHILDREN = {"steps": _steps_child, "memory": _memory_child, "resume": _resume_child}


def _spawn(role: str, spec: dict, work: Path) -> dict:
    path = work / f"{role}-spec.json"
    path.write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}  # as the local launcher runs a rank
    proc = subprocess.run([sys.executable, "-m", "tests.bench.bench_data", role, str(path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    if proc.returncode:
        raise RuntimeError(f"the {role} process exited {proc.returncode}: {proc.stderr[-1500:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------- the rows
def _prepare_rows(work: Path, rounds: int) -> tuple[list[dict], str, Any]:
    """Row 3: prepare of the whole standard library against ``encode`` on the same files; the store
    and manifest of the last prepare (row 1's dataset)."""
    from relaunch.components.core.data.shards import WRITE_THREADS, commit_source
    from relaunch.components.core.store import open_store
    from relaunch.components.tasks.lm import corpus_files, encode, make_task

    config = lm_config(str(work / "lm-store"), ["train.task_options.max_corpus_bytes=1000000000"])
    task = make_task(config)
    o = task.o
    files = corpus_files(o["corpus"], o["max_corpus_bytes"])
    nbytes = sum(size for _, _, size in files)
    paths = [str(path) for _, path, _ in files]

    def tokenizer() -> float:
        t0 = time.perf_counter()
        tokens = 0
        for _, path, size in files:
            with open(path, "rb") as fh:
                tokens += len(encode(fh.read(size)))
        seconds = time.perf_counter() - t0
        if tokens != nbytes:
            raise AssertionError(f"the tokenizer made {tokens} tokens of {nbytes} bytes")
        return seconds

    theirs: list[float] = []
    ours: list[float] = []
    built: list[float] = []
    read: list[float] = []
    floor: list[float] = []
    resident: list[float] = []
    before = _load()
    root = ""
    manifest = written = None
    payloads: list[bytes] = []
    for r in range(rounds):
        resident.append(rawread.settle(paths, "warm"))
        theirs.append(tokenizer())
        resident.append(rawread.settle(paths, "warm"))
        root = str(work / f"prepare-{r}")
        os.sync()
        t0 = time.perf_counter()
        source = task.build_dataset()
        t1 = time.perf_counter()
        manifest, written = commit_source(open_store(root), source)
        ours.append(time.perf_counter() - t0)
        built.append(t1 - t0)
        resident.append(rawread.settle(paths, "warm"))
        t0 = time.perf_counter()
        task.build_dataset().source_key  # the listing, then every file read and hashed: no cutting, no writes
        read.append(time.perf_counter() - t0)
        if not payloads:
            store = open_store(root)
            payloads = [store.read_bytes(s.key) for shards in manifest.splits.values() for s in shards]
        os.sync()
        floor.append(disk_write(payloads, work / f"disk-{r}"))
        shutil.rmtree(work / f"disk-{r}")
        if r < rounds - 1:
            shutil.rmtree(root)
    t0 = time.perf_counter()
    again, second = commit_source(open_store(root), task.build_dataset())
    again_s = time.perf_counter() - t0
    load = f"load {before}->{_load()}"
    if again.version != manifest.version:
        raise AssertionError(f"a second prepare of the same corpus found {again.version}, not {manifest.version}")
    t_med, o_med = statistics.median(theirs), statistics.median(ours)
    token_dtype = manifest.dtype["tokens"].base.name
    ratio = t_med / o_med
    tokens_mb = nbytes / 1e6
    rows = [
        _row("prepare / the tokenizer alone, bytes of corpus per second (both read the files from disk, page "
             "cache warm)", ratio, f">= {GOALS['prepare']:g}", ratio >= GOALS["prepare"],
             f"encode on the files read: {tokens_mb / t_med:.0f} MB/s ({t_med * 1e3:.1f} ms)",
             f"prepare (the LM task's build_dataset() committed by commit_source into a new fs store, every shard "
             f"fsync'd) {tokens_mb / o_med:.1f} MB/s ({o_med * 1e3:.0f} ms: build_dataset() lists the corpus (walk, "
             f"sizes, splits) in {statistics.median(built) * 1e3:.0f} ms, then a thread reads each file once into its "
             f"split's sequences and hashes it for the source key while the shards are cut and written); its parts "
             f"alone: the listing and the read and hash, nothing cut or written, "
             f"{statistics.median(read) * 1e3:.0f} ms; the disk "
             f"alone writing and fsyncing the same {sum(map(len, payloads)) / 1e6:.1f} MB of shards ({token_dtype} tokens), one "
             f"after another, {statistics.median(floor) * 1e3:.0f} ms (best {min(floor) * 1e3:.0f}; encode / that: "
             f"{t_med / statistics.median(floor):.3f}; prepare writes {WRITE_THREADS} at once); medians of "
             f"{rounds} interleaved rounds, best: encode {min(theirs) * 1e3:.1f} ms, prepare {min(ours) * 1e3:.0f} ms "
             f"(ratio {min(theirs) / min(ours):.3f}); the whole stdlib: {len(files)} files, {tokens_mb:.2f} MB, "
             f"{manifest.samples('train')} train sequences in {len(manifest.split('train'))} shards; resident "
             f"before each side {min(resident):.0%}; {load}", bug=ratio > 1.0),
        _row("objects written by a second prepare of the same corpus", float(second), "= 0", second == 0,
             f"the first prepare wrote {written}",
             f"the second found version {again.version} in {again_s * 1e3:.0f} ms (the corpus walked, read and cut "
             f"again: each shard and the manifest, content-addressed, found in the store, none written)"),
    ]
    return rows, root, manifest


def _step_rows(work: Path, root: str, manifest, rounds: int) -> list[dict]:
    """Row 1: the LM's step streamed against the same step from memory."""
    config = lm_config(root)
    g = config.train.global_batch_size
    boundary = window_boundary([s.samples for s in manifest.split("train")], config.train.seed, g)
    steps = BLOCK * rounds
    start = boundary - steps // 2 - 1  # the pass's first batch is the resume's; the timed steps start one later
    files = shard_files(root, manifest)
    before = _load()
    out = _spawn("steps", {"uri": root, "version": manifest.version, "start": start, "block": BLOCK,
                           "rounds": rounds, "files": files}, work)
    load = f"load {before}->{_load()}"
    mem, streamed = out["memory"], out["streamed"]
    ratio = statistics.median(streamed) / statistics.median(mem)
    best = min(streamed) / min(mem)
    mean = statistics.mean(streamed) / statistics.mean(mem)
    paired = statistics.median(statistics.median(streamed[r * BLOCK:(r + 1) * BLOCK])
                               / statistics.median(mem[r * BLOCK:(r + 1) * BLOCK]) for r in range(rounds))
    ms = 1e3
    return [_row("step time, batches streamed by ShardLoader (1 worker, fs store, resident) / the same batches in "
                 "memory (median step)", ratio, f"<= {GOALS['keeps_up']:g}", ratio <= GOALS["keeps_up"],
                 f"from memory: median {statistics.median(mem) * ms:.1f} ms, min {min(mem) * ms:.1f} ms a step",
                 f"streamed: median {statistics.median(streamed) * ms:.1f} ms, min {min(streamed) * ms:.1f} ms a step "
                 f"(ratio of the mins {best:.3f}, of the means {mean:.3f}, median of the rounds' own ratios "
                 f"{paired:.3f}); "
                 f"{steps} steps a side in {rounds} rounds "
                 f"of {BLOCK}, the two sides' blocks alternated (the same steps' batches), one streamed pass from step "
                 f"{start + 1} across the window boundary at step {boundary} (the next window's shards fetched "
                 f"mid-pass), every streamed batch checked equal to the one held; the pass's first batch untimed; "
                 f"configs/lm.yaml's model and step (global batch {g} on one process, "
                 f"{config.train.grad_accum_steps} micro-batches, clipping at {config.train.grad_clip_norm}), "
                 f"OMP_NUM_THREADS=1; the {len(files)} shards resident before the pass: {out['resident']:.0%}; {load}",
                 bug=ratio < 1 / GOALS["keeps_up"] and best < 1 / GOALS["keeps_up"])]


def _memory_rows(work: Path, root: str, small, big, scaled: str) -> list[dict]:
    """Row 2: a rank's peak RSS over ~2 GB of shards against ~20 MB."""
    config = lm_config(root)
    g = config.train.global_batch_size
    results = {}
    for name, manifest in (("small", small), ("big", big)):
        boundary = window_boundary([s.samples for s in manifest.split("train")], config.train.seed, g)
        out = _spawn("memory", {"uri": root, "version": manifest.version, "start": boundary - MEMORY_STEPS // 2,
                                "steps": MEMORY_STEPS}, work)
        out["total"] = sum(out["peaks"].values())
        out["bytes"] = sum(s.bytes for s in manifest.split("train"))
        results[name] = out
    s, b = results["small"], results["big"]
    growth = (b["total"] - s["total"]) / 1e6

    def parts(r: dict) -> str:
        main = r["peaks"][str(r["main"])]
        others = [v for k, v in r["peaks"].items() if k != str(r["main"])]
        return (f"{r['total'] / 1e6:.0f} MB = training process {main / 1e6:.0f} MB (before the loader started "
                f"{r['before_loader'] / 1e6:.0f} MB) + {len(others)} loader worker(s) "
                f"{'+'.join(f'{v / 1e6:.0f}' for v in others)} MB; {r['shards_read']} of {r['shards']} shards read")

    return [_row("peak RSS of a rank (training process + loader workers) streaming ~2 GB of shards - streaming ~20 MB",
                 growth, f"< {GOALS['rss_mb']:g} MB", growth < GOALS["rss_mb"],
                 f"~20 MB ({s['bytes'] / 1e6:.0f} MB of shards): {s['total'] / 1e6:.0f} MB",
                 f"~2 GB ({b['bytes'] / 1e9:.2f} GB of shards): {parts(b)}; ~20 MB: {parts(s)}; each a new process "
                 f"training {MEMORY_STEPS} steps of configs/lm.yaml across a window boundary, peaks (VmHWM) read "
                 f"before the pass ends; synthetic token rows written by DatasetWriter{scaled}")]


def _resume_rows(work: Path, root: str, big, rounds: int) -> list[dict]:
    """Row 4: the loader's position restored at a mid-epoch step against step 0."""
    config = lm_config(root)
    g, seed = config.train.global_batch_size, config.train.seed
    spe = big.samples("train") // g
    mid = spe // 2 + 3  # mid-epoch and inside a window
    prefetch = config.data.prefetch_batches * config.data.num_workers
    which = shards_of_steps(big, seed, g, list(range(prefetch + 1)) + list(range(mid, mid + prefetch + 1)))
    files = shard_files(root, big, which)
    rawread.settle(files, "warm")
    before = _load()
    out = _spawn("resume", {"uri": root, "version": big.version, "mid": mid, "rounds": rounds, "files": files}, work)
    load = f"load {before}->{_load()}"
    med = {k: {n: statistics.median(v) * 1e3 for n, v in out[k].items()} for k in ("first", "sampler", "started")}
    low = {k: {n: min(v) * 1e3 for n, v in out[k].items()} for k in ("first", "sampler", "started")}
    cost = med["first"]["mid"] - med["first"]["0"]
    goal = GOALS["position_ms"]
    where = (f"the {big.samples('train')} samples of {len(big.split('train'))} shards ({spe} steps an epoch), "
             f"mid-epoch step {mid}; {rounds} rounds, the order of the two alternated; in a process holding the "
             f"LM's model and AdamW after a step, OMP_NUM_THREADS=1; the {len(files)} shards the two starts read "
             f"resident before each: {min(out['resident']):.0%}; {load}")
    return [
        _row("loader position restore: batches(step) -> first batch in hand, a mid-epoch step - step 0 (ms, median)",
             cost, f"<= {goal:g} ms", cost <= goal,
             f"step 0: {med['first']['0']:.1f} ms (best {low['first']['0']:.1f})",
             f"mid-epoch: {med['first']['mid']:.1f} ms (best {low['first']['mid']:.1f}), the worker started and its "
             f"window's shards fetched and checked; {where}"),
        _row("the position restore itself at a mid-epoch step: the sampler at the step + the worker started "
             "(ms, median)", med["started"]["mid"], f"<= {goal:g} ms", med["started"]["mid"] <= goal,
             f"step 0: {med['started']['0']:.1f} ms (best {low['started']['0']:.1f})",
             f"best {low['started']['mid']:.1f} ms; of it the sampler at the step and its first indices "
             f"{med['sampler']['mid']:.2f} ms (step 0: {med['sampler']['0']:.2f} ms), the rest the DataLoader's "
             f"worker started with its first indices queued; the rest of the first batch's wait is the shards' "
             f"fetch: {med['first']['mid'] - med['started']['mid']:.1f} ms; {where}"),
    ]


def _big_datasets(work: Path, quick: bool) -> tuple[str, Any, Any, str]:
    """The ~20 MB and ~2 GB synthetic datasets in one fs store on a real disk (scaled to the disk)."""
    from relaunch.components.core.store import open_store

    root = str(work / "synthetic-store")
    want = BIG_BYTES // 8 if quick else BIG_BYTES
    usage = shutil.disk_usage(work)
    size = fit_to_disk(want, usage.free, disk_margin(usage.free))
    scaled = ""
    if size < want:
        scaled = (f"; SCALED DOWN from {want / 1e9:.2f} GB to {size / 1e9:.2f} GB: {usage.free / 1e9:.1f} GB free on "
                  f"{work}, {disk_margin(usage.free) / 1e9:.1f} GB kept free")
        _log(scaled[2:])
    if size < 10 * SMALL_BYTES:
        raise RuntimeError(f"only {size / 1e6:.0f} MB fit on {work}: free some space or set BENCH_DATA_DIR")
    store = open_store(root)
    t0 = time.perf_counter()
    small, _ = write_synthetic(store, SMALL_BYTES, seed=1)
    big, written = write_synthetic(store, size, seed=2)
    seconds = time.perf_counter() - t0
    _log(f"synthetic datasets: {SMALL_BYTES / 1e6:.0f} MB and {size / 1e9:.2f} GB ({written} objects) written in "
         f"{seconds:.1f} s under {work} ({fstype(work)})")
    note = f" on {fstype(work)} under {work} in {seconds:.0f} s, deleted at the end{scaled}"
    return root, small, big, note


def run(quick: bool) -> list[dict]:
    """Rows of the benchmark table (see the module docstring)."""
    from relaunch.components.core.runtime.wiring import wire

    wire()  # this process is an entry point: configurations validate against the full tables
    work = work_dir()
    rounds = 8 if quick else ROUNDS
    wanted = rows_wanted(os.environ.get("BENCH_DATA_ROWS", ""))
    rows: dict[str, list[dict]] = {}
    try:
        _log(f"prepare of the standard library against the tokenizer ({PREPARE_ROUNDS} rounds)")
        rows["prepare"], lm_root, lm_manifest = _prepare_rows(work, PREPARE_ROUNDS)
        if "steps" in wanted:
            _log(f"the LM's step streamed against from memory ({rounds} rounds of {BLOCK} steps a side)")
            rows["steps"] = _step_rows(work, lm_root, lm_manifest, rounds)
        if {"memory", "resume"} & wanted:
            root, small, big, note = _big_datasets(work, quick)
        if "memory" in wanted:
            _log(f"a rank's peak RSS over {small.samples('train')} and {big.samples('train')} sequences")
            rows["memory"] = _memory_rows(work, root, small, big, note)
        if "resume" in wanted:
            _log(f"the loader's position: a mid-epoch step against step 0 ({RESUME_ROUNDS} rounds)")
            rows["resume"] = _resume_rows(work, root, big, 5 if quick else RESUME_ROUNDS)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return [row for name in ROW_GROUPS if name in rows for row in rows[name]]


if __name__ == "__main__":
    from relaunch.components.core.runtime.wiring import wire

    wire()
    print(json.dumps(CHILDREN[sys.argv[1]](json.loads(Path(sys.argv[2]).read_text()))), flush=True)
