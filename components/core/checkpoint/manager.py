"""The checkpoint life cycle of one training: save, commit, locate, load, retention.

    with CheckpointManager("s3://bucket/exp/run", keep_last=3, keep_best=1, best_metric="val_loss") as mgr:
        info = mgr.load(state)                 # newest committed checkpoint, resharded to this world
        mgr.save(step, state, metrics={...})   # every rank; returns once the state is snapshotted to CPU
        mgr.wait()                             # the pending save is committed (or its error is raised)

    A trainer may overlap the copy of the parameters and optimizer state with the next step:
        mgr.save(step, state, defer_copy=True) # returns once the copy is started
        forward_backward()                     # only reads what the background thread copies
        mgr.wait_for_snapshot()                # before optimizer.step(), scheduler.step(), scaler.update()

Every rank writes its own DCP shards straight into the store and reads only the items its load plan
names (``dcp_io``); the manifest, the commit point, carries a digest of every chunk, checked as the
bytes arrive. The commit protocol and the layout are in ``docs/checkpoint-format.md``. Under
``torch.distributed`` the manager makes its own gloo group (and one per node, for replicated state),
so a background save's collectives never interleave with the training process group.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import shutil
import sys
import tempfile
import threading
import time
import warnings
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

from components.core.checkpoint import quarantine
from components.core.checkpoint.layout import (FORMAT_VERSION, INFLIGHT, LATEST, MANIFEST, MANIFEST_DIGEST,
                                               METADATA, PINS, PREFIX, CheckpointInfo, checkpoint_steps, info_of,
                                               now, parse_checkpoint_uri, parse_manifest, parse_pin, pin_key,
                                               read_json, read_manifest_bytes, sealed_manifest_body, step_key,
                                               versions, write_conditional)
from components.core.checkpoint.lease import Lease, LeaseLost, default_owner
from components.core.checkpoint.readers import ReadLeases, claim_for_deletion, deletion_done
from components.core.checkpoint.retention import apply_retention
from components.core.checkpoint.snapshot import Snapshotter, copy_deferred, state_bytes
from components.core.checkpoint.verify import CHUNK_BYTES, DIGEST, ChunkDigests, check_files, deep_verify
from components.core.contract.classify import CarriedError, dcp_original
from components.core.contract.errors import BadInput, CorruptCheckpoint, RelaunchError
from components.core.store import FileStore, PreconditionFailed, Store, open_store

if TYPE_CHECKING:
    import torch

# A single process is a supported use (tests, evaluation, the CLI): DCP's note about it is noise.
warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled, unavailable or uninitialized")

FILE_BYTES = 64 * 1024 * 1024  # a rank's state is spread over files of about this size (a file is
# the most one ranged read asks for; many files also give S3 parallel uploads and downloads)
IO_THREADS = max(1, min(4, os.cpu_count() or 1))
READ_THREADS = 8  # ranged reads (GETs) in flight per rank on S3; on a filesystem IO_THREADS, each one
# file front to back (more concurrent streams made cold reads slower on the 2-core machine's disk)


class _Job:
    def __init__(self, step: int, epoch: int, snapshot: Any, metrics: dict[str, float], started: float):
        self.step, self.epoch, self.snapshot, self.metrics, self.started = step, epoch, snapshot, metrics, started
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (snapshot buffer, live tensor) still to copy
        self.copied = threading.Event()
        self.cuda_ready: torch.cuda.Event | None = None  # recorded after the work the snapshot must see
        self.cuda_device: int | None = None
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.info: CheckpointInfo | None = None


class CheckpointManager:
    """Owns the checkpoint life cycle of one training run in one store root.

    Args:
        store: a store URI (path, file:///path, s3://bucket/prefix) or an open :class:`Store`.
        keep_last: committed checkpoints kept by recency; 0 keeps every checkpoint.
        keep_best: checkpoints kept by ``best_metric`` (ties: the newer step wins).
        best_metric: metric name used by ``keep_best``.
        mode: ``"min"`` or ``"max"`` for ``best_metric``.
        async_save: persist and commit in a background thread (the next save waits for it).
        process_group: unused when None; when ``torch.distributed`` is initialized a dedicated gloo
            group is created (collectively: every rank must construct the manager).
        owner: the logical writer holding the lease (default: $RELAUNCH_OWNER, the pipeline run id or
            $TORCHELASTIC_RUN_ID, else host:pid). Who may take a lease over: :mod:`lease`.
        lease_seconds: how long the write lease and the read leases last without a renewal; a
            heartbeat thread (rank 0) renews them every third of it while the manager is open.
        lease_wait_seconds: how long taking the write lease waits for a live holder of the same
            owner (default: ``lease_seconds``); another owner's live lease is refused at once.
        model_fingerprint: stored in each manifest; a load of a checkpoint with another fingerprint
            raises BadInput. Computed from ``TrainingState.model`` when not given.
        cache_dir: local directory for downloads of format-1 checkpoints from S3 (default: a temp
            dir, made on first use and removed at close).
        ranks_per_node: ranks that share a node (default: $LOCAL_WORLD_SIZE); replicated state is
            read once per node and broadcast to the others. ``world_size`` reads it once per job.
    """

    def __init__(self, store: str | Store, *, keep_last: int = 3, keep_best: int = 0,
                 best_metric: str | None = None, mode: str = "min", async_save: bool = True,
                 process_group: Any = None, owner: str | None = None, lease_seconds: float = 300,
                 model_fingerprint: str | None = None, cache_dir: str | os.PathLike | None = None,
                 ranks_per_node: int | None = None, lease_wait_seconds: float | None = None):
        if mode not in ("min", "max"):
            raise BadInput(f"checkpoint mode {mode!r} must be 'min' or 'max'")
        if keep_best and not best_metric:
            raise BadInput("keep_best needs best_metric (the metric name to rank checkpoints by)")
        if keep_last < 0 or keep_best < 0:
            raise BadInput(f"keep_last ({keep_last}) and keep_best ({keep_best}) must be >= 0")
        self.store: Store = open_store(store) if isinstance(store, str) else store
        self.keep_last, self.keep_best, self.best_metric, self.mode = keep_last, keep_best, best_metric, mode
        self.async_save = async_save
        self.owner = owner or default_owner()
        self.lease = Lease(self.store, self.owner, lease_seconds, wait_seconds=lease_wait_seconds)
        self.lease_seconds = float(lease_seconds)
        self._reads: dict[str, ReadLeases] = {}  # store URI -> the read leases held there (rank 0)
        self._heartbeat: threading.Thread | None = None
        self._stop_beat = threading.Event()
        self.model_fingerprint = model_fingerprint
        self.last_save_seconds: float | None = None
        self.stall_seconds_total = 0.0
        self._lease_checked = False
        self._latest_etag: str | None = None
        self._latest_known = False
        self._manifests: dict[int, dict[str, Any]] = {}
        # damage found by this process: (store URI, step) -> (manifest sha256, reason); it holds even
        # where the store refused the quarantine marker (read-only credentials)
        self._damaged: dict[tuple[str, int], tuple[str, str]] = {}
        self._snapshots = Snapshotter()
        self._pending: _Job | None = None
        self._last_info: CheckpointInfo | None = None
        self._closed = False
        self._cache_dir = Path(cache_dir) if cache_dir is not None else None
        self._own_cache: Path | None = None
        dist = sys.modules.get("torch.distributed")  # an initialized process group imported it already
        self._distributed = dist is not None and dist.is_available() and dist.is_initialized()
        self._node_group, self._node_ranks = None, None
        if self._distributed:
            self._group = process_group or dist.new_group(backend="gloo")
            self.rank = dist.get_rank(self._group)
            self.world_size = dist.get_world_size(self._group)
            self._make_node_groups(ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size)))
        else:
            self._group, self.rank, self.world_size = None, 0, 1
        _OPEN.add(self)

    def _make_node_groups(self, per_node: int) -> None:
        """One gloo group per node (collective: every rank makes every group, in the same order)."""
        import torch.distributed as dist

        if per_node <= 1 or self.world_size % per_node or per_node > self.world_size:
            return
        self._node_ranks = [list(range(n, n + per_node)) for n in range(0, self.world_size, per_node)]
        if per_node == self.world_size:
            self._node_group = self._group
            return
        me = dist.get_rank()
        for ranks in self._node_ranks:
            group = dist.new_group(ranks, backend="gloo")
            if me in ranks:
                self._node_group = group

    @classmethod
    def from_config(cls, config: Any, **overrides: Any) -> "CheckpointManager":
        """The manager of "this training": store from ``config.store.uri``, retention from
        ``config.train`` (keep_last, keep_best, best_metric, best_mode, async_save); keyword
        ``overrides`` win (e.g. ``async_save=False`` for a read-only step, ``owner=run_id``)."""
        train = config.train
        kwargs: dict[str, Any] = dict(keep_last=train.keep_last, keep_best=train.keep_best,
                                      best_metric=train.best_metric,
                                      mode=train.best_mode, async_save=train.async_save)
        kwargs.update(overrides)
        return cls(config.store.uri, **kwargs)

    # ------------------------------------------------------------------ public API
    def save(self, step: int, state: Any, metrics: dict | None = None, epoch: int = 0, *,
             defer_copy: bool = False) -> None:
        """Snapshot ``state`` to CPU and persist it as checkpoint ``step`` (every rank calls it).

        Returns once the snapshot is taken (async) or the checkpoint is committed (sync). With
        ``defer_copy`` (async only) it returns sooner: the small state (counters, RNG, scheduler,
        scaler, buffers) is copied here, and the model parameters and optimizer state are copied by
        the background thread while the caller runs the next forward and backward, which only read
        them; the caller must then call :meth:`wait_for_snapshot` before changing them in place.
        Raises the error of the previous background save, if it failed, and BadInput when another
        writer holds the store's lease.
        """
        self._guard()
        t0 = time.perf_counter()
        try:
            self.wait()
            step_key(step)
            if self.model_fingerprint is None and hasattr(state, "model"):
                from components.core.trainer.state import model_fingerprint

                self.model_fingerprint = model_fingerprint(state.model)
            if not self._lease_checked:
                self.take_lease()  # a second writer is refused right here, if not before training
            if self.rank == 0:
                self._release_reads()  # what this writer loaded is in its state now
            if epoch == 0 and hasattr(state, "epoch"):
                epoch = int(state.epoch)
            job = _Job(step, int(epoch), None, {k: float(v) for k, v in (metrics or {}).items()}, t0)
            job.snapshot = self._snapshots.take(state, job.copies if self.async_save and defer_copy else None)
            import torch

            if torch.cuda.is_available():
                job.cuda_device = torch.cuda.current_device()  # the background thread's would be device 0
                job.cuda_ready = torch.cuda.Event()
                job.cuda_ready.record()
            self._pending = job
            if self.async_save:
                job.thread = threading.Thread(target=self._run_job, args=(job,), name=f"ckpt-save-{step}",
                                              daemon=True)
                job.thread.start()
            else:
                self._run_job(job)
        finally:
            self.stall_seconds_total += time.perf_counter() - t0
        if not self.async_save:
            self.wait()

    def wait_for_snapshot(self) -> float:
        """Block until the pending save has copied the state it saves; return the seconds blocked.

        ``save(..., defer_copy=True)`` copies the model parameters and optimizer state on its
        background thread, overlapped with the next step's forward and backward (which only read
        them). Call this right before anything changes them in place: ``optimizer.step()``,
        ``scheduler.step()``, ``scaler.update()``. save(), wait(), load() and close() wait for the
        copy themselves. With no deferred copy pending it returns 0.0 at once.
        """
        job = self._pending
        if job is None or job.copied.is_set():
            return 0.0
        t0 = time.perf_counter()
        job.copied.wait()
        blocked = time.perf_counter() - t0
        self.stall_seconds_total += blocked
        return blocked

    def wait(self) -> CheckpointInfo | None:
        """Block until the pending save is committed and return its info (with no save pending: the
        info of the last save this manager committed, or None); raise the pending save's error."""
        job, self._pending = self._pending, None
        if job is None:
            return self._last_info
        if job.thread is not None:
            job.thread.join()
        if job.error is not None:
            raise job.error
        self._last_info = job.info
        return job.info

    def latest(self) -> CheckpointInfo | None:
        """The newest committed checkpoint that is not quarantined, whose manifest parses and matches
        its own digest and whose files all exist with their sizes, or None (rank 0 decides; O(1)
        requests, no data read: the bytes are checked by the read that loads them). A checkpoint
        found damaged on the way is quarantined (docs/checkpoint-format.md, "Quarantine")."""
        self._guard()
        self.wait()
        return self._agree(self._rank0(self._locate_leased))

    def load(self, state: Any, step: int | None = None, uri: str | None = None) -> CheckpointInfo | None:
        """Restore ``state`` in place from ``step``/``uri`` (default: the latest); None if there is none.

        With neither, a checkpoint found damaged while it is read is skipped by every rank together
        and the previous committed one is loaded instead. Either way a damaged checkpoint is
        quarantined: never chosen again, and its step may be saved again.

        Raises:
            CorruptCheckpoint: the asked-for checkpoint does not verify, or holds unsafe objects.
            BadInput: the checkpoint belongs to another model, is of a newer format, or is not in the store.
        """
        self._guard()
        self.wait()
        store = self.store
        if uri is not None:
            root, step = parse_checkpoint_uri(uri)
            if root.rstrip("/") != self.store.uri.rstrip("/"):
                store = open_store(root)
        damaged: set[int] = set()
        while True:
            if step is None:
                info = self._agree(self._rank0(lambda: self._locate_leased(skip=damaged)))
            else:
                info = self._agree(self._rank0(lambda: self._read_lease(
                    store, step, lambda: self._checked(step, store), wait=True)))
            if info is None:
                return None
            manifest = self._agree(self._rank0(lambda: self._manifest(info.step, store)))
            self._check_fingerprint(info, manifest, state)
            try:
                self._read(state, info, manifest, store)
            except CorruptCheckpoint as err:
                self._found_damaged(store, info.step, info.manifest_sha256, str(err))
                if step is not None:
                    raise
                print(f"relaunch: checkpoint {info.uri} is damaged ({err}); loading the previous committed "
                      f"checkpoint instead", file=sys.stderr, flush=True)
                damaged.add(info.step)
                continue
            if store is self.store:
                self._latest_known = False
            return info

    def list(self) -> list[CheckpointInfo]:
        """Every intact committed checkpoint, oldest first: its manifest matches its digest, every
        file it lists exists with its size, it is not quarantined (no data read). One found damaged
        here is quarantined and left out: :meth:`quarantined` lists those."""
        self._guard()
        out = []
        for step in checkpoint_steps(self.store):
            try:
                out.append(self._checked(step))
            except (CorruptCheckpoint, FileNotFoundError):
                continue
        return out

    def quarantined(self) -> list[dict[str, Any]]:
        """The damaged checkpoints of the store, by step: each quarantine record (``step``,
        ``reason``, ``found_at``, ``found_by``, ``manifest_sha256``; ``moved_to``: None while the
        checkpoint is still in its step directory, else the folder it was moved aside to), plus
        damage this process found but could not record in the store (``"recorded": False``)."""
        self._guard()
        out = [{**r, "recorded": True} for r in quarantine.records(self.store)]
        in_place = {(r["step"], r.get("manifest_sha256")) for r in out if r["moved_to"] is None}
        for (uri, step), (sha, reason) in sorted(self._damaged.items()):
            if uri == self.store.uri and (step, sha) not in in_place:
                out.append({"step": step, "manifest_sha256": sha, "reason": reason, "moved_to": None,
                            "recorded": False})
        return sorted(out, key=lambda r: r["step"])

    def verify(self, step: int, deep: bool = True) -> CheckpointInfo:
        """Check checkpoint ``step`` against its manifest: with ``deep`` every byte (format 1: each
        file's sha256; format 2: every chunk digest), else that every file exists with its size.

        A checkpoint found damaged is quarantined; one quarantined before is reported as such.

        Raises:
            CorruptCheckpoint: missing, malformed or altered manifest, a missing, truncated or
                altered file, or a quarantined checkpoint.
            BadInput: a checkpoint of a newer format.
        """
        self._guard()
        # manifest digest, files and sizes (quarantined: raises), under a read lease
        manifest = self._read_lease(self.store, step, lambda: self._manifest(step), wait=True)
        if deep:
            try:
                deep_verify(self.store, step, manifest)
            except CorruptCheckpoint as err:
                self._found_damaged(self.store, step, manifest["_sha256"], str(err))
                raise
        return info_of(self.store, step, manifest)

    def best(self, metric: str | None = None, mode: str | None = None) -> CheckpointInfo | None:
        """The committed checkpoint with the best ``metric`` (default: ``best_metric``/``mode``) whose
        files are all there; ties go to the newer step; None when no checkpoint has the metric."""
        self._guard()
        metric, mode = metric or self.best_metric, mode or self.mode
        if not metric:
            raise BadInput("best() needs a metric name (best_metric)")
        scored = [i for i in self.list() if metric in i.metrics]  # intact ones only
        scored.sort(key=lambda i: (i.metrics[metric] if mode == "min" else -i.metrics[metric], -i.step))
        for info in scored:
            if self._read_lease(self.store, info.step, lambda: self._checked(info.step), wait=False) is not None:
                return info
        return None

    def pin(self, step: int, reason: str) -> None:
        """Protect committed checkpoint ``step`` from retention until unpinned with the same reason."""
        self._guard()
        # raises CorruptCheckpoint if not committed; the read lease holds it until the pin is written
        self._read_lease(self.store, step, lambda: self._manifest(step), wait=True)
        body = json.dumps({"step": step, "reason": reason, "created_at": now(), "owner": self.owner})
        self.store.write_bytes(pin_key(step, reason), body.encode())

    def unpin(self, step: int, reason: str) -> None:
        """Remove the pin ``reason`` of ``step`` (no error if it was not pinned)."""
        self._guard()
        self.store.delete(pin_key(step, reason))

    def pins(self) -> dict[int, list[str]]:
        """Pinned steps and their reasons."""
        out: dict[int, list[str]] = {}
        for key in self.store.list(PINS + "/"):
            parsed = parse_pin(key)
            if parsed:
                out.setdefault(parsed[0], []).append(parsed[1])
        return out

    def take_lease(self) -> None:
        """Take the store's write lease now (every rank calls it; rank 0 takes it), start its
        heartbeat and abort the multipart uploads a killed writer left. A trainer calls it before it
        trains, so that a second run is refused before it does any work; ``save`` calls it otherwise.

        Raises:
            BadInput: another writer holds the lease (one line; see :mod:`lease` for who may take it).
        """
        self._guard()
        self._agree(self._rank0(self._take_lease))
        self._lease_checked = True

    def close(self) -> None:
        """Wait for the pending save, release the write and read leases; idempotent. Raises the
        pending save's error."""
        if self._closed:
            return
        self._closed = True
        _OPEN.discard(self)
        try:
            self.wait()
        finally:
            self._stop_beat.set()
            if self.rank == 0:
                self._release_reads()
                self.lease.release()
            if self._own_cache is not None:
                shutil.rmtree(self._own_cache, ignore_errors=True)

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ collectives
    def _catch(self, fn):
        try:
            return ("ok", fn())
        except BaseException as err:  # noqa: BLE001 - carried to every rank, re-raised below
            return ("err", err)

    def _rank0(self, fn):
        """Run ``fn`` on rank 0 only; the outcome is handed to :meth:`_agree`."""
        return self._catch(fn) if self.rank == 0 else ("ok", None)

    def _agree(self, outcome, share: bool = True):
        """Gather every rank's outcome; raise the first error on every rank, else return rank 0's
        value (``share``) or this rank's own."""
        kind, value = outcome
        if not self._distributed:
            if kind == "err":
                raise value
            return value
        import torch.distributed as dist

        local = (kind, CarriedError.of(value) if kind == "err" else value)
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, local if share and self.rank == 0 or kind == "err" else ("ok", None),
                               group=self._group)
        for r, (k, v) in enumerate(gathered):
            if k == "err":
                if kind == "err":
                    raise value
                raise v.rebuild(f"rank {r}: ")
        return gathered[0][1] if share else value

    # ------------------------------------------------------------------ snapshot & persist
    def _take_lease(self) -> None:
        self.lease.take()
        self._latest_etag = self.store.etag(LATEST)
        self._latest_known = True
        self._start_heartbeat()
        self.store.abort_incomplete_uploads(PREFIX + "/")  # a killed writer's: nobody else writes here now

    # ------------------------------------------------------------------ leases (rank 0)
    def _start_heartbeat(self) -> None:
        """Renew the write lease and the read leases every third of ``lease_seconds`` until close.
        The thread holds the manager weakly: a manager dropped unclosed stops renewing."""
        if self._heartbeat is not None:
            return
        ref, stop, interval = weakref.ref(self), self._stop_beat, max(0.05, self.lease_seconds / 3)

        def beat() -> None:
            while not stop.wait(interval):
                mgr = ref()
                if mgr is None:
                    return
                try:
                    mgr._beat()
                except LeaseLost as err:
                    print(f"relaunch: {err}", file=sys.stderr, flush=True)
                except Exception:  # noqa: BLE001 - a store hiccup: the next beat retries, the fence decides
                    pass
                del mgr

        self._heartbeat = threading.Thread(target=beat, name="ckpt-lease-heartbeat", daemon=True)
        self._heartbeat.start()

    def _beat(self) -> None:
        for reads in list(self._reads.values()):
            reads.renew()
        if self.lease.etag is not None and self.lease.lost is None:
            self.lease.renew()

    def _read_lease(self, store: Store, step: int, check, *, wait: bool):
        """``check()`` under a read lease on ``step`` (:meth:`ReadLeases.acquire`)."""
        return self._reads_in(store).acquire(step, check, wait=wait)

    def _reads_in(self, store: Store) -> ReadLeases:
        reads = self._reads.get(store.uri)
        if reads is None:
            reads = self._reads[store.uri] = ReadLeases(store, self.owner, self.lease_seconds)
        self._start_heartbeat()
        return reads

    def _release_reads(self) -> None:
        for reads in self._reads.values():
            reads.release_all()

    def _locate_leased(self, skip: set[int] | frozenset = frozenset()) -> CheckpointInfo | None:
        """:meth:`_locate`, then a read lease on the answer, checked again under it; a step being
        deleted meanwhile is passed over for the next one."""
        passed: set[int] = set()
        reads = self._reads_in(self.store)
        for attempt in range(10):
            # lease the steps latest.json and inflight.json name before _locate checks them: a writer
            # faster than this reader would otherwise delete each one before its check is done
            pointers = (read_json(self.store, LATEST) or {}, read_json(self.store, INFLIGHT) or {})
            early = {p["step"] for p in pointers if isinstance(p.get("step"), int)} - set(skip) - passed
            for step in early:
                reads.hold(step)
            info = self._locate(skip=set(skip) | passed)
            for step in early:
                if (info is None or step != info.step) and step not in reads.confirmed:
                    reads.release(step)
            if info is None:
                # a writer that commits (and deletes) faster than this reader locates can leave it
                # nothing it checked in time: start over while latest.json names a step
                pointer = read_json(self.store, LATEST) or {}
                if attempt < 9 and (passed or isinstance(pointer.get("step"), int) and pointer["step"] not in skip):
                    passed.clear()
                    continue
                return None
            leased = self._read_lease(self.store, info.step, lambda: self._checked(info.step), wait=False)
            if leased is not None:
                return leased
            passed.add(info.step)
        return None

    def _claim(self, step: int) -> bool:
        return claim_for_deletion(self.store, step, token=self.lease.token, seconds=self.lease_seconds,
                                  fence=self.lease.fence)

    def _run_job(self, job: _Job) -> None:
        try:
            copy_deferred(job)
            job.info = self._persist(job)
            self.last_save_seconds = time.perf_counter() - job.started
        except BaseException as err:  # noqa: BLE001 - surfaces at the next save()/wait()
            job.error = err
        finally:
            job.snapshot = None

    def _persist(self, job: _Job) -> CheckpointInfo:
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        from components.core.checkpoint.dcp_io import StoreWriter

        self._agree(self._rank0(lambda: self._preflight(job.step)))
        files_per_rank = max(1, -(-state_bytes(job.snapshot) // FILE_BYTES))
        writer = StoreWriter(self.store, step_key(job.step), files_per_rank=files_per_rank, threads=IO_THREADS)

        def write() -> dict[str, dict[str, Any]]:
            from torch.distributed.checkpoint.api import CheckpointException

            try:
                dcp.save(job.snapshot, storage_writer=writer, process_group=self._group)
            except CheckpointException as err:  # DCP wraps what the store raised: surface that
                raise dcp_original(err) from None
            return writer.files

        outcome = self._catch(write)
        if self._distributed:
            gathered: list[Any] = [None] * self.world_size
            local = outcome if outcome[0] == "ok" else ("err", CarriedError.of(outcome[1]))
            dist.all_gather_object(gathered, local, group=self._group)
            if outcome[0] == "err":
                raise outcome[1]
            files: dict[str, Any] = {}
            for r, (kind, value) in enumerate(gathered):
                if kind == "err":
                    raise value.rebuild(f"rank {r}: ")
                files.update(value)
        else:
            if outcome[0] == "err":
                raise outcome[1]
            files = outcome[1]
        return self._agree(self._rank0(lambda: self._commit(job, files)))

    def _preflight(self, step: int) -> None:
        self.lease.fence()  # a renewal, off the training thread; a writer taken over stops here
        key = step_key(step)
        if self.store.exists(f"{key}/{MANIFEST}"):
            try:
                self._checked(step)
            except CorruptCheckpoint as err:  # damaged (quarantined now if not before): write it again
                self._move_aside(step, str(err))
            else:
                raise BadInput(f"checkpoint {self.store.uri_for(key)} is already committed; refusing to "
                               f"overwrite it (save a later step)")
        self.store.write_bytes(INFLIGHT, json.dumps({"step": step, "owner": self.owner,
                                                     "started_at": now()}).encode())

    def _commit(self, job: _Job, files: dict[str, Any]) -> CheckpointInfo:
        key = step_key(job.step)
        manifest = {
            "format_version": FORMAT_VERSION, "step": job.step, "epoch": job.epoch,
            "world_size": self.world_size, "created_at": now(), "files": dict(sorted(files.items())),
            "digest": DIGEST, "chunk_bytes": CHUNK_BYTES, "byteorder": sys.byteorder,
            "metrics": job.metrics, "versions": versions(), "model_fingerprint": self.model_fingerprint,
            "owner": self.owner,
        }
        body = sealed_manifest_body(manifest)
        self.lease.fence()  # a writer that lost its lease (stalled past it) commits nothing
        self.store.write_bytes(f"{key}/{MANIFEST}", body)  # the commit point
        manifest["_sha256"] = hashlib.sha256(body).hexdigest()
        self._manifests[job.step] = manifest
        self._advance_latest(job.step, manifest["_sha256"])
        for deleted in apply_retention(self.store, keep_last=self.keep_last, keep_best=self.keep_best,
                                       best_metric=self.best_metric, mode=self.mode, in_flight=job.step,
                                       manifest=self._manifest, claim=self._claim,
                                       done=lambda s: deletion_done(self.store, s)):
            self._manifests.pop(deleted, None)
        return info_of(self.store, job.step, manifest)

    def _advance_latest(self, step: int, sha: str) -> None:
        body = json.dumps({"step": step, "path": step_key(step), "manifest_sha256": sha}).encode()
        if not self._latest_known:
            self._latest_etag = self.store.etag(LATEST)
            self._latest_known = True
        try:
            if self._latest_etag is None:
                if not self.store.write_if_absent(LATEST, body) and self.store.read_bytes(LATEST) != body:
                    raise PreconditionFailed("latest.json appeared")
                self._latest_etag = self.store.etag(LATEST)
            else:
                self._latest_etag = write_conditional(self.store, LATEST, body, if_match=self._latest_etag)
        except PreconditionFailed:
            if self.store.read_bytes(LATEST) != body:  # not just our own retried request landing twice
                raise BadInput(f"{self.store.uri_for(LATEST)} was changed by another writer; "
                               f"refusing to interleave histories") from None
            self._latest_etag = self.store.etag(LATEST)

    # ------------------------------------------------------------------ locate & check
    def _locate(self, skip: set[int] | frozenset = frozenset()) -> CheckpointInfo | None:
        """latest.json and inflight.json first (3 reads and one listing), the step directories
        newest first only when both fail."""
        tried: set[int] = set(skip)
        pointer = read_json(self.store, LATEST)
        inflight = read_json(self.store, INFLIGHT)
        p = pointer.get("step") if pointer else None
        q = inflight.get("step") if inflight else None
        if isinstance(q, int) and q not in tried and (not isinstance(p, int) or q > p):
            tried.add(q)  # committed after the pointer was last advanced (a crash in between)?
            if (info := self._checked_quiet(q)) is not None:
                return info
        if isinstance(p, int) and p not in tried:
            tried.add(p)
            try:
                manifest = self._manifest(p)
            except (CorruptCheckpoint, FileNotFoundError):
                manifest = None
            # another manifest than the pointer's: edited (a legacy one, without its own digest), or
            # the step was written again after a damaged one and the crash came before the pointer
            if manifest is not None and (manifest["_sha256"] == pointer.get("manifest_sha256")
                                         or MANIFEST_DIGEST in manifest):
                return info_of(self.store, p, manifest)
        for step in reversed(checkpoint_steps(self.store)):
            if step in tried:
                continue
            if (info := self._checked_quiet(step)) is not None:
                return info
        return None

    def _manifest(self, step: int, store: Store | None = None) -> dict[str, Any]:
        """The manifest of committed checkpoint ``step`` after the O(1) check: not quarantined, the
        manifest parses and matches its own digest, every listed file exists with its size. What
        fails the check is damage: quarantined here, then raised.

        Raises:
            CorruptCheckpoint: not committed (no manifest: not damage, nothing recorded) or damaged.
            BadInput: a checkpoint of a newer format (not damage either).
        """
        store = store or self.store
        raw = read_manifest_bytes(store, step)
        sha = hashlib.sha256(raw).hexdigest()
        uri = store.uri_for(step_key(step))
        known = self._damaged.get((store.uri, step))
        if known is not None and known[0] == sha:
            raise CorruptCheckpoint(f"{uri} is damaged: {known[1]}")
        record = quarantine.find(store, step, sha)
        if record is not None:
            raise CorruptCheckpoint(f"{uri} is quarantined as damaged since {record.get('found_at', '?')} "
                                    f"({record.get('reason', '?')})")
        try:
            manifest = parse_manifest(store, step, raw)
            check_files(store, step, manifest)
        except CorruptCheckpoint as err:
            self._found_damaged(store, step, sha, str(err))
            raise
        return manifest

    def _checked(self, step: int, store: Store | None = None) -> CheckpointInfo:
        store = store or self.store
        return info_of(store, step, self._manifest(step, store))

    def _found_damaged(self, store: Store, step: int, manifest_sha256: str, reason: str) -> None:
        """Record checkpoint ``step`` as damaged: here, and in the store (rank 0, best effort)."""
        self._damaged[(store.uri, step)] = (manifest_sha256, reason)
        if self.rank == 0:
            quarantine.record(store, step, manifest_sha256, reason, found_by=self.owner)

    def _move_aside(self, step: int, reason: str) -> None:
        """Lease holder, before saving damaged ``step`` again: move the old checkpoint out of the way."""
        try:
            sha = hashlib.sha256(read_manifest_bytes(self.store, step)).hexdigest()
        except CorruptCheckpoint:
            return  # gone meanwhile (a person removed it): nothing to move
        rec = quarantine.find(self.store, step, sha) or {"step": step, "manifest_sha256": sha, "reason": reason,
                                                         "found_at": now(), "found_by": self.owner}
        dest = quarantine.move_aside(self.store, step, rec, moved_by=self.owner)
        self._damaged.pop((self.store.uri, step), None)
        self._manifests.pop(step, None)
        print(f"relaunch: damaged checkpoint {self.store.uri_for(step_key(step))} moved aside to "
              f"{self.store.uri_for(dest)}; saving step {step} again", file=sys.stderr, flush=True)

    def _checked_quiet(self, step: int) -> CheckpointInfo | None:
        try:
            return self._checked(step)
        except (CorruptCheckpoint, FileNotFoundError):
            return None

    # ------------------------------------------------------------------ load
    def _check_fingerprint(self, info: CheckpointInfo, manifest: dict[str, Any], state: Any) -> None:
        mine = self.model_fingerprint
        if mine is None and hasattr(state, "model"):
            from components.core.trainer.state import model_fingerprint

            mine = model_fingerprint(state.model)
        theirs = manifest.get("model_fingerprint")
        if mine and theirs and mine != theirs:
            raise BadInput(f"checkpoint of another model: {info.uri} was written for model {theirs}, "
                           f"this model is {mine} (wrong store URI or model config?)")
        if manifest.get("byteorder", "little") != sys.byteorder:
            raise BadInput(f"{info.uri} was written on a {manifest.get('byteorder')}-endian machine; "
                           f"this one is {sys.byteorder}-endian")

    def _cache(self) -> Path:
        if self._cache_dir is not None:
            return self._cache_dir
        if self._own_cache is None:
            self._own_cache = Path(tempfile.mkdtemp(prefix="relaunch-ckpt-"))
        return self._own_cache

    def _read(self, state: Any, info: CheckpointInfo, manifest: dict[str, Any], store: Store) -> None:
        """Load the checkpoint into ``state`` with DCP (every rank)."""
        from components.core.checkpoint.safe_pickle import load_metadata

        if manifest["format_version"] == 1:
            from components.core.checkpoint import legacy_v1

            cache = None if type(store) is FileStore else self._cache()  # a local store is read in place
            local = self._agree(self._catch(lambda: str(legacy_v1.materialize(
                store, info.step, manifest, cache))), share=False)
            metadata = legacy_v1.read_metadata(local)
            reader = legacy_v1.safe_reader(local)
        else:
            from components.core.checkpoint.dcp_io import StoreReader, payload_offsets

            digests = ChunkDigests(info.uri, manifest["files"])
            body = self._agree(self._rank0(lambda: self._metadata_bytes(store, info, digests)))
            metadata = load_metadata(body, source=f"{info.uri}/{METADATA}")
            payloads = payload_offsets(manifest["files"]) if manifest["format_version"] >= 3 else None
            reader = StoreReader(store, info.key, metadata, digests, payloads=payloads, node_group=self._node_group,
                                 node_ranks=self._node_ranks,
                                 threads=IO_THREADS if hasattr(store, "path") else READ_THREADS)
        self._dcp_load(state, metadata, reader, info)

    def _metadata_bytes(self, store: Store, info: CheckpointInfo, digests: ChunkDigests) -> bytes:
        """``.metadata``, read once per job (rank 0) and checked against its digest."""
        try:
            body = store.read_bytes(f"{info.key}/{METADATA}")
        except FileNotFoundError:
            raise CorruptCheckpoint(f"{info.uri}/{METADATA} is missing") from None
        digests.check(METADATA, 0, body)
        return body

    def _dcp_load(self, state: Any, metadata: Any, reader: Any, info: CheckpointInfo) -> None:
        stored = set(metadata.state_dict_metadata)
        wrapped = hasattr(state, "state_dict") and hasattr(state, "load_state_dict") and not isinstance(state, dict)
        undo = state.prepare_load(metadata.state_dict_metadata) if wrapped and hasattr(state, "prepare_load") else None
        try:
            self._dcp_load_into(state, wrapped, stored, reader, info)
        except BaseException:
            if undo is not None:
                undo()
            raise

    def _dcp_load_into(self, state: Any, wrapped: bool, stored: set[str], reader: Any, info: CheckpointInfo) -> None:
        import torch
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.stateful import Stateful

        from components.core.checkpoint.dcp_io import safe_load_planner

        template = state.state_dict() if wrapped else dict(state)
        if isinstance(template.get("rng"), dict):  # another world size: a rank's stream may be absent
            for name in list(template["rng"]):
                if not any(k.startswith(f"rng.{name}.") for k in stored):
                    del template["rng"][name]
            if not template["rng"]:
                del template["rng"]
        try:
            dcp.load(template, storage_reader=reader, planner=safe_load_planner(), process_group=self._group)
        except RelaunchError:
            raise
        except (Exception, CheckpointException) as err:  # DCP wraps per-rank errors (a BaseException)
            original = dcp_original(err)  # a damaged checkpoint first: every rank then falls back together
            if isinstance(original, BadInput) and not isinstance(original, CorruptCheckpoint):
                raise BadInput(f"checkpoint of another model: {info.uri} does not fit this state ({original})") from None
            if isinstance(original, RelaunchError):
                raise original from None
            raise
        if wrapped:
            state.load_state_dict(template)
        else:
            for k, v in template.items():
                if isinstance(state.get(k), Stateful) and not isinstance(state[k], torch.Tensor):
                    pass  # DCP called load_state_dict on it already
                else:
                    state[k] = v

    def _guard(self) -> None:
        if self._closed:
            raise RuntimeError("CheckpointManager is closed")


_OPEN: "weakref.WeakSet[CheckpointManager]" = weakref.WeakSet()


@atexit.register
def _close_at_exit() -> None:
    """At interpreter exit (after the non-daemon threads are joined, while the background save still
    runs): close every manager left open, so that a pending save commits and no lease is left behind.
    A save that fails here ends the process with its exit code and one line saying so."""
    failed: BaseException | None = None
    for mgr in list(_OPEN):
        try:
            mgr.close()
        except BaseException as err:  # noqa: BLE001 - reported below, then the exit code says it
            first = (str(err).splitlines() or [""])[0][:300]
            print(f"relaunch: the checkpoint save pending at exit did not complete: {type(err).__name__}: {first}",
                  file=sys.stderr, flush=True)
            failed = failed or err
    if failed is not None:
        sys.stdout.flush()
        os._exit(int(getattr(failed, "exit_code", 1)))
