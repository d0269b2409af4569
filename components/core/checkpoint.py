"""Crash-consistent checkpoints on a filesystem or S3: save, commit, locate, load, retention.

    mgr = CheckpointManager("s3://bucket/exp/run", keep_last=3, keep_best=1, best_metric="val_loss")
    info = mgr.load(state)                 # newest committed checkpoint, resharded to this world size
    mgr.save(step, state, metrics={...})   # every rank; returns once the state is snapshotted to CPU
    mgr.wait()                             # the pending save is committed (or its error is raised)
    mgr.close()

The on-store layout and the commit protocol are documented in ``docs/checkpoint-format.md``; in
short: DCP files under ``checkpoints/step-<012d>/``, then ``MANIFEST.json`` (the commit point, with
size and sha256 of every file), then ``latest.json``. A checkpoint exists iff its manifest exists and
matches its files. Under ``torch.distributed`` the manager creates its own gloo group, so the
collectives of a background save never interleave with the training process group.
"""

from __future__ import annotations

import concurrent.futures
import copy
import dataclasses
import datetime as _dt
import hashlib
import json
import os
import platform
import re
import shutil
import socket
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import warnings

from components.core.errors import BadInput, CorruptCheckpoint, RelaunchError, TransientFailure
from components.core.storage import FileStore, PreconditionFailed, Store, open_store

# A single process is a supported use (tests, evaluation, the CLI): DCP's note about it is noise.
warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled, unavailable or uninitialized")

FORMAT_VERSION = 1
PREFIX = "checkpoints"
LATEST = f"{PREFIX}/latest.json"
INFLIGHT = f"{PREFIX}/inflight.json"
LEASE = f"{PREFIX}/LEASE.json"
PINS = f"{PREFIX}/pins"
MANIFEST = "MANIFEST.json"
_STEP_DIR = re.compile(r"^step-(\d{12})$")
_HASH_CHUNK = 8 * 1024 * 1024
_IO_THREADS = max(1, min(4, os.cpu_count() or 1))
_SPLIT_BYTES = 64 * 1024 * 1024  # a rank's state above this is written as _IO_THREADS files
_DIRECT_MIN_BYTES = 256 * 1024  # stored tensors from this size on are read straight into place


def step_key(step: int) -> str:
    """``checkpoints/step-<012d>``: the key of a step's directory."""
    if not isinstance(step, int) or step < 0 or step >= 10**12:
        raise BadInput(f"checkpoint step {step!r} must be an integer in [0, 10^12)")
    return f"{PREFIX}/step-{step:012d}"


def parse_checkpoint_uri(uri: str) -> tuple[str, int]:
    """Split ``<root>/checkpoints/step-<012d>[/MANIFEST.json]`` into (store root URI, step).

    Raises:
        BadInput: the URI does not name a checkpoint directory.
    """
    text = str(uri).rstrip("/")
    if text.endswith("/" + MANIFEST):
        text = text[: -len(MANIFEST) - 1]
    root, sep, tail = text.rpartition(f"/{PREFIX}/")
    m = _STEP_DIR.match(tail)
    if not sep or not m or not root:
        raise BadInput(f"{uri!r} is not a checkpoint URI; expected <store>/{PREFIX}/step-<12 digits>")
    return root, int(m.group(1))


@dataclasses.dataclass
class CheckpointInfo:
    """A committed checkpoint, as its manifest describes it."""

    step: int
    uri: str
    key: str
    epoch: int
    world_size: int
    created_at: str
    metrics: dict[str, float]
    manifest_sha256: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class _Job:
    def __init__(self, step: int, epoch: int, snapshot: Any, metrics: dict[str, float], started: float):
        self.step, self.epoch, self.snapshot, self.metrics, self.started = step, epoch, snapshot, metrics, started
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.info: CheckpointInfo | None = None


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _advise(fd: int, offset: int, length: int, advice: str) -> None:
    fn = getattr(os, "posix_fadvise", None)
    if fn is not None:
        try:
            fn(fd, offset, length, getattr(os, advice))
        except OSError:
            pass  # only a hint (some filesystems refuse it)


def _sha256_file(path: Path) -> tuple[int, str]:
    # readinto one reused buffer: a fresh 8 MiB bytes object per chunk costs page faults that add
    # ~20 % to hashing; the read-ahead hint keeps a cold file's I/O ahead of the hashing.
    h = hashlib.sha256()
    size = 0
    buf = bytearray(_HASH_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as fh:
        _advise(fh.fileno(), 0, 0, "POSIX_FADV_SEQUENTIAL")
        while True:
            _advise(fh.fileno(), size + _HASH_CHUNK, 4 * _HASH_CHUNK, "POSIX_FADV_WILLNEED")
            n = fh.readinto(buf)
            if not n:
                break
            h.update(view[:n])
            size += n
    return size, h.hexdigest()


def _hash_files(paths: dict[str, Path]) -> dict[str, dict[str, Any]]:
    """size and sha256 of each file, hashed in parallel (hashlib releases the GIL)."""
    with concurrent.futures.ThreadPoolExecutor(max(1, min(_IO_THREADS, len(paths)))) as pool:
        results = dict(zip(paths, pool.map(_sha256_file, paths.values())))
    return {name: {"size": size, "sha256": digest} for name, (size, digest) in sorted(results.items())}


def _file_signature(path: Path) -> tuple[int, int, int, int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _io_threads(snapshot: Any) -> int:
    """DCP files per rank: one for a small state, else one per core (up to 4), so that writing,
    hashing and verifying a large checkpoint run in parallel (sha256 is ~1 GB/s on one core)."""
    import torch

    total = 0

    def visit(obj: Any) -> None:
        nonlocal total
        if isinstance(obj, torch.Tensor):
            total += obj.numel() * obj.element_size()
        elif isinstance(obj, dict):
            for v in obj.values():
                visit(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                visit(v)

    visit(snapshot)
    return 1 if total < _SPLIT_BYTES else _IO_THREADS


def _versions() -> dict[str, str]:
    import torch

    try:
        from importlib.metadata import version

        relaunch = version("relaunch")
    except Exception:  # noqa: BLE001 - not installed as a distribution (a source checkout)
        relaunch = "unknown"
    return {"relaunch": relaunch, "torch": torch.__version__, "python": platform.python_version()}


def _default_owner() -> str:
    for name in ("RELAUNCH_OWNER", "RELAUNCH_PIPELINE_RUN_ID", "TORCHELASTIC_RUN_ID"):
        if os.environ.get(name):
            return os.environ[name]
    return f"{socket.gethostname()}:{os.getpid()}"


_ERRORS = {cls.__name__: cls for cls in (BadInput, CorruptCheckpoint, TransientFailure, PreconditionFailed)}


# ----------------------------------------------------------------------------- safe DCP reading

def _safe_reader(path: str | os.PathLike):
    import torch
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta
    from torch.distributed.checkpoint.planner import LoadItemType
    from torch.distributed.checkpoint.utils import _create_file_view

    from components.core.safe_pickle import load_metadata

    class SafeFileSystemReader(FileSystemReader):
        """DCP's filesystem reader with ``.metadata`` read through the restricted unpickler, and
        plain tensors read straight from the file into their destination (one copy, not three)."""

        def read_metadata(self, *args: Any, **kwargs: Any):
            path = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(path, "rb") as fh:
                metadata = load_metadata(fh, source=str(path))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

        def read_data(self, plan, planner):
            # DCP's own reader torch.loads each tensor into a fresh buffer and then copies it into
            # the destination; here a dense tensor whose destination has its exact shape, dtype and
            # layout is read into the destination directly. Anything else goes the stock way.
            other = []
            per_file: dict[str, list[Any]] = {}
            for req in plan.items:
                md = self.storage_data[req.storage_index]
                if req.type == LoadItemType.BYTE_IO or md.transform_descriptors:
                    other.append(req)
                else:
                    per_file.setdefault(md.relative_path, []).append(req)
            for relative_path, reqs in per_file.items():
                with open(self.fs.concat_path(self.path, relative_path), "rb") as stream:
                    _advise(stream.fileno(), 0, 0, "POSIX_FADV_SEQUENTIAL")
                    for req in sorted(reqs, key=lambda r: self.storage_data[r.storage_index].offset):
                        if not self._read_direct(stream, req, planner):
                            other.append(req)
            if other:
                return super().read_data(dataclasses.replace(plan, items=other), planner)
            fut: torch.futures.Future = torch.futures.Future()
            fut.set_result(None)
            return fut

        def _read_direct(self, stream, req, planner) -> bool:
            md = self.storage_data[req.storage_index]
            if md.length < _DIRECT_MIN_BYTES:  # parsing the header twice costs more than the copy saves
                return False
            # the tensor's header only (shape, dtype, strides, where its bytes start), weights_only
            meta = torch.load(_create_file_view(stream, md.offset, md.length), map_location="meta",
                              weights_only=True)
            start = getattr(meta.untyped_storage(), "_checkpoint_offset", None)
            nbytes = meta.numel() * meta.element_size()
            archive = torch._C.PyTorchFileReader(_create_file_view(stream, md.offset, md.length))
            foreign = archive.has_record("byteorder") and archive.get_record("byteorder") != sys.byteorder.encode()
            if (not isinstance(start, int) or foreign or not meta.is_contiguous()
                    or meta.storage_offset() != 0 or meta.untyped_storage().nbytes() != nbytes
                    or any(req.storage_offsets) or list(req.lengths) != list(meta.shape)
                    or start + nbytes > md.length):
                return False
            target = planner.resolve_tensor(req).detach()
            if (target.device.type != "cpu" or target.dtype != meta.dtype or target.shape != meta.shape
                    or not target.is_contiguous()):
                return False
            if nbytes:
                view = memoryview(target.reshape(-1).view(torch.uint8).numpy())
                stream.seek(md.offset + start)
                done = 0
                while done < nbytes:
                    n = stream.readinto(view[done:])
                    if not n:
                        raise CorruptCheckpoint(f"{Path(self.path) / md.relative_path} ends inside "
                                                f"{req.storage_index.fqn!r}")
                    done += n
            planner.commit_tensor(req, target)
            return True

    return SafeFileSystemReader(path)


def _safe_load_planner():
    import torch
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element as _set

    class SafeLoadPlanner(DefaultLoadPlanner):
        """Non-tensor values load with ``torch.load(weights_only=True)``, never a full unpickle."""

        def load_bytes(self, read_item, value) -> None:
            try:
                obj = torch.load(value, weights_only=True)
            except Exception as err:  # noqa: BLE001 - any unpickling refusal means an unsafe item
                raise CorruptCheckpoint(f"checkpoint item {read_item.dest_index.fqn!r} is not safely "
                                        f"loadable (weights_only): {str(err).splitlines()[0][:200]}") from None
            if self.flatten_state_dict:
                _set(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return SafeLoadPlanner()


def read_metadata(path: str | os.PathLike):
    """DCP metadata of a local checkpoint directory, read safely."""
    from components.core.safe_pickle import load_metadata

    with open(Path(path) / ".metadata", "rb") as fh:
        return load_metadata(fh, source=str(Path(path) / ".metadata"))


# ----------------------------------------------------------------------------- the manager

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
            $TORCHELASTIC_RUN_ID, else host:pid). The same owner may re-take its lease at once.
        lease_seconds: how long the lease lasts without a renewal (each save renews it).
        model_fingerprint: stored in each manifest; a load of a checkpoint with another fingerprint
            raises BadInput. Computed from ``TrainingState.model`` when not given.
        cache_dir: local directory for S3 staging/downloads (default: a temp dir removed at close).
    """

    def __init__(self, store: str | Store, *, keep_last: int = 3, keep_best: int = 0,
                 best_metric: str | None = None, mode: str = "min", async_save: bool = True,
                 process_group: Any = None, owner: str | None = None, lease_seconds: float = 300,
                 model_fingerprint: str | None = None, cache_dir: str | os.PathLike | None = None):
        if mode not in ("min", "max"):
            raise BadInput(f"checkpoint mode {mode!r} must be 'min' or 'max'")
        if keep_best and not best_metric:
            raise BadInput("keep_best needs best_metric (the metric name to rank checkpoints by)")
        if keep_last < 0 or keep_best < 0:
            raise BadInput(f"keep_last ({keep_last}) and keep_best ({keep_best}) must be >= 0")
        self.store: Store = open_store(store) if isinstance(store, str) else store
        self.keep_last, self.keep_best, self.best_metric, self.mode = keep_last, keep_best, best_metric, mode
        self.async_save = async_save
        self.owner = owner or _default_owner()
        self.lease_seconds = float(lease_seconds)
        self.model_fingerprint = model_fingerprint
        self.last_save_seconds: float | None = None
        self.stall_seconds_total = 0.0
        self._token = uuid.uuid4().hex
        self._lease_etag: str | None = None
        self._lease_checked = False
        self._latest_etag: str | None = None
        self._latest_known = False
        self._manifests: dict[int, dict[str, Any]] = {}
        self._buffers: dict[str, torch.Tensor] = {}
        self._verified: dict[tuple[str, str], dict[str, tuple[int, ...]]] = {}
        self._pending: _Job | None = None
        self._last_info: CheckpointInfo | None = None
        self._closed = False
        self._own_cache = cache_dir is None
        self._cache = Path(cache_dir or tempfile.mkdtemp(prefix="relaunch-ckpt-"))
        dist = sys.modules.get("torch.distributed")  # never imported: not initialized (readers skip torch)
        self._distributed = dist is not None and dist.is_available() and dist.is_initialized()
        if self._distributed:
            self._group = process_group or dist.new_group(backend="gloo")
            self.rank = dist.get_rank(self._group)
            self.world_size = dist.get_world_size(self._group)
        else:
            self._group, self.rank, self.world_size = None, 0, 1
        self._direct = type(self.store) is FileStore  # DCP writes straight into the shared directory

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

    def best(self, metric: str | None = None, mode: str | None = None) -> CheckpointInfo | None:
        """The committed checkpoint with the best ``metric`` (default: ``best_metric``/``mode``) whose
        files verify; ties go to the newer step; None when no checkpoint has the metric."""
        self._guard()
        metric, mode = metric or self.best_metric, mode or self.mode
        if not metric:
            raise BadInput("best() needs a metric name (best_metric)")
        scored = [i for i in self.list() if metric in i.metrics]
        scored.sort(key=lambda i: (i.metrics[metric] if mode == "min" else -i.metrics[metric], -i.step))
        for info in scored:
            if self._verify_quiet(info.step) is not None:
                return info
        return None

    # ------------------------------------------------------------------ public API
    def save(self, step: int, state: Any, metrics: dict | None = None, epoch: int = 0) -> None:
        """Snapshot ``state`` to CPU and persist it as checkpoint ``step`` (every rank calls it).

        Returns once the snapshot is taken (async) or the checkpoint is committed (sync). Raises the
        error of the previous background save, if it failed, and BadInput when another writer holds
        the store's lease.
        """
        self._guard()
        t0 = time.perf_counter()
        try:
            self.wait()
            step_key(step)
            if self.model_fingerprint is None and hasattr(state, "model"):
                from components.core.state import model_fingerprint

                self.model_fingerprint = model_fingerprint(state.model)
            if self._lease_etag is None and not self._lease_checked:
                self._agree(self._rank0(self._take_lease))  # a second writer is refused right here
                self._lease_checked = True
            if epoch == 0 and hasattr(state, "epoch"):
                epoch = int(state.epoch)
            job = _Job(step, int(epoch), self._snapshot(state),
                       {k: float(v) for k, v in (metrics or {}).items()}, t0)
            if self.async_save:
                job.thread = threading.Thread(target=self._run_job, args=(job,), name=f"ckpt-save-{step}",
                                              daemon=True)
                self._pending = job
                job.thread.start()
            else:
                self._pending = job
                self._run_job(job)
        finally:
            self.stall_seconds_total += time.perf_counter() - t0
        if not self.async_save:
            self.wait()

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
        """The newest committed checkpoint whose files verify, or None (rank 0 decides)."""
        self._guard()
        self.wait()
        info = self._rank0(self._locate)
        return self._agree(info)

    def load(self, state: Any, step: int | None = None, uri: str | None = None) -> CheckpointInfo | None:
        """Restore ``state`` in place from ``step``/``uri`` (default: the latest); None if there is none.

        Raises:
            CorruptCheckpoint: the asked-for checkpoint does not verify, or holds unsafe objects.
            BadInput: the checkpoint belongs to another model or is not in the store.
        """
        self._guard()
        self.wait()
        store = self.store
        if uri is not None:
            root, step = parse_checkpoint_uri(uri)
            if root.rstrip("/") != self.store.uri.rstrip("/"):
                store = open_store(root)
        if step is None:
            info = self.latest()
        else:
            info = self._agree(self._rank0(lambda: self._verify(step, store=store)))
        if info is None:
            return None
        manifest = self._agree(self._rank0(lambda: self._manifest(info.step, store=store)))
        self._check_fingerprint(info, manifest, state)
        local = self._agree(self._catch(lambda: str(self._materialize(info.step, manifest, store=store,
                                                                        verified=False))), share=False)
        self._dcp_load(state, Path(local), info)
        if store is self.store:
            self._latest_known = False
        return info

    def list(self) -> list[CheckpointInfo]:
        """Every checkpoint with a well-formed manifest, oldest first (files not re-hashed)."""
        self._guard()
        out = []
        for step in self._step_dirs():
            try:
                out.append(self._info(step, self._manifest(step)))
            except (CorruptCheckpoint, FileNotFoundError):
                continue
        return out

    def verify(self, step: int) -> CheckpointInfo:
        """Check checkpoint ``step`` against its manifest (every file's size and sha256).

        Raises:
            CorruptCheckpoint: missing or malformed manifest, a missing, truncated or altered file.
        """
        self._guard()
        return self._verify(step)

    def pin(self, step: int, reason: str) -> None:
        """Protect committed checkpoint ``step`` from retention until unpinned with the same reason."""
        self._guard()
        self._manifest(step)  # raises CorruptCheckpoint if not committed
        body = json.dumps({"step": step, "reason": reason, "created_at": _now(), "owner": self.owner})
        self.store.write_bytes(self._pin_key(step, reason), body.encode())

    def unpin(self, step: int, reason: str) -> None:
        """Remove the pin ``reason`` of ``step`` (no error if it was not pinned)."""
        self._guard()
        self.store.delete(self._pin_key(step, reason))

    def pins(self) -> dict[int, list[str]]:
        """Pinned steps and their reasons."""
        out: dict[int, list[str]] = {}
        for key in self.store.list(PINS + "/"):
            parsed = _parse_pin(key)
            if parsed:
                out.setdefault(parsed[0], []).append(parsed[1])
        return out

    def close(self) -> None:
        """Wait for the pending save, release the lease; idempotent. Raises the pending save's error."""
        if self._closed:
            return
        self._closed = True
        try:
            self.wait()
        finally:
            if self._lease_etag is not None and self.rank == 0:
                try:
                    self.store.delete(LEASE)
                except (RelaunchError, OSError):
                    pass  # an expired lease is as good as a released one
                self._lease_etag = None
            if self._own_cache:
                shutil.rmtree(self._cache, ignore_errors=True)

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

        local = (kind, _portable(value) if kind == "err" else value)
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, local if share and self.rank == 0 or kind == "err" else ("ok", None),
                               group=self._group)
        for r, (k, v) in enumerate(gathered):
            if k == "err":
                if kind == "err":
                    raise value
                cls, msg = v
                raise _ERRORS.get(cls, RuntimeError)(f"rank {r}: {msg}")
        return gathered[0][1] if share else value

    # ------------------------------------------------------------------ lease
    def _take_lease(self) -> None:
        now = time.time()
        body = json.dumps({"owner": self.owner, "token": self._token, "host": socket.gethostname(),
                           "pid": os.getpid(), "acquired_at": _now(),
                           "expires_at": now + self.lease_seconds}).encode()
        if self._lease_etag is not None:
            try:
                self._lease_etag = _write(self.store, LEASE, body, if_match=self._lease_etag)
                return
            except PreconditionFailed:
                current = _read_json(self.store, LEASE)
                if not current or current.get("token") != self._token:
                    raise BadInput(f"lost the write lease on {self.store.uri}: "
                                   f"{(current or {}).get('owner')!r} took it over (was this run stalled "
                                   f"for longer than lease_seconds={self.lease_seconds:g}?)") from None
                self._lease_etag = self.store.etag(LEASE)
                return
        if self.store.write_if_absent(LEASE, body):
            self._lease_etag = self.store.etag(LEASE)
        else:
            etag = self.store.etag(LEASE)
            current = _read_json(self.store, LEASE) or {}
            mine = current.get("token") == self._token or current.get("owner") == self.owner
            expired = float(current.get("expires_at", 0) or 0) < now
            if not (mine or expired):
                raise BadInput(
                    f"store {self.store.uri} is being written by {current.get('owner')!r} "
                    f"(host {current.get('host')}, pid {current.get('pid')}) until "
                    f"{_dt.datetime.fromtimestamp(float(current.get('expires_at', 0)), _dt.timezone.utc).isoformat(timespec='seconds')}; "
                    f"refusing a second writer (a pipeline started twice?). Wait for it to finish or "
                    f"for the lease to expire")
            try:
                self._lease_etag = _write(self.store, LEASE, body, if_match=etag)
            except PreconditionFailed:
                raise BadInput(f"another writer took the lease on {self.store.uri} at the same time") from None
        self._latest_etag = self.store.etag(LATEST)
        self._latest_known = True

    # ------------------------------------------------------------------ snapshot & persist
    def _snapshot(self, state: Any) -> Any:
        """A CPU copy of ``state.state_dict()`` that training can no longer change."""
        import torch

        if hasattr(state, "state_dict") and not isinstance(state, dict):
            sd = state.state_dict()
        else:
            sd = {k: (v.state_dict() if hasattr(v, "state_dict") and not isinstance(v, torch.Tensor) else v)
                  for k, v in dict(state).items()}
        pin = torch.cuda.is_available()
        return self._copy(sd, "", pin)

    def _copy(self, obj: Any, path: str, pin: bool) -> Any:
        import torch

        if isinstance(obj, torch.Tensor):
            src = obj.detach()
            buf = self._buffers.get(path)
            if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
                buf = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=pin and src.is_cuda)
                self._buffers[path] = buf
            buf.copy_(src, non_blocking=pin and src.is_cuda)
            return buf
        if isinstance(obj, dict):
            return {k: self._copy(v, f"{path}.{k}", pin) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            items = [self._copy(v, f"{path}.{i}", pin) for i, v in enumerate(obj)]
            return type(obj)(items) if isinstance(obj, list) else tuple(items)
        return copy.deepcopy(obj)

    def _run_job(self, job: _Job) -> None:
        import torch

        try:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            job.info = self._persist(job)
            self.last_save_seconds = time.perf_counter() - job.started
        except BaseException as err:  # noqa: BLE001 - surfaces at the next save()/wait()
            job.error = err
        finally:
            job.snapshot = None

    def _persist(self, job: _Job) -> CheckpointInfo:
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        key = step_key(job.step)
        self._agree(self._rank0(lambda: self._preflight(job.step)))
        if self._direct:
            target = self.store.path(key)  # type: ignore[attr-defined]
            target.mkdir(parents=True, exist_ok=True)
        else:
            target = self._cache / f"stage-{job.step:012d}-rank{self.rank}"
            shutil.rmtree(target, ignore_errors=True)
            target.mkdir(parents=True)

        def write_and_hash() -> dict[str, dict[str, Any]]:
            from torch.distributed.checkpoint import FileSystemWriter

            writer = FileSystemWriter(target, thread_count=_io_threads(job.snapshot), sync_files=True)
            dcp.save(job.snapshot, storage_writer=writer, process_group=self._group)
            mine = {p.name: p for p in target.iterdir() if p.is_file()
                    and (p.name.startswith(f"__{self.rank}_") or (self.rank == 0 and p.name == ".metadata"))}
            files = _hash_files(mine)
            if not self._direct:
                for name, path in mine.items():
                    self.store.upload_file(f"{key}/{name}", path)
                shutil.rmtree(target, ignore_errors=True)
            return files

        outcome = self._catch(write_and_hash)
        if self._distributed:
            gathered: list[Any] = [None] * self.world_size
            local = outcome if outcome[0] == "ok" else ("err", _portable(outcome[1]))
            dist.all_gather_object(gathered, local, group=self._group)
            if outcome[0] == "err":
                raise outcome[1]
            files: dict[str, Any] = {}
            for r, (kind, value) in enumerate(gathered):
                if kind == "err":
                    raise _ERRORS.get(value[0], RuntimeError)(f"rank {r}: {value[1]}")
                files.update(value)
        else:
            if outcome[0] == "err":
                raise outcome[1]
            files = outcome[1]
        return self._agree(self._rank0(lambda: self._commit(job, files)))

    def _preflight(self, step: int) -> None:
        if self._lease_etag is not None:
            self._take_lease()  # renewal, off the training thread
        key = step_key(step)
        if self.store.exists(f"{key}/{MANIFEST}"):
            raise BadInput(f"checkpoint {self.store.uri_for(key)} is already committed; refusing to "
                           f"overwrite it (save a later step)")
        self.store.write_bytes(INFLIGHT, json.dumps({"step": step, "owner": self.owner,
                                                     "started_at": _now()}).encode())

    def _commit(self, job: _Job, files: dict[str, Any]) -> CheckpointInfo:
        key = step_key(job.step)
        manifest = {
            "format_version": FORMAT_VERSION, "step": job.step, "epoch": job.epoch,
            "world_size": self.world_size, "created_at": _now(), "files": files,
            "metrics": job.metrics, "versions": _versions(), "model_fingerprint": self.model_fingerprint,
            "owner": self.owner,
        }
        body = json.dumps(manifest, indent=2, sort_keys=True).encode()
        self.store.write_bytes(f"{key}/{MANIFEST}", body)  # the commit point
        sha = hashlib.sha256(body).hexdigest()
        self._manifests[job.step] = manifest
        self._advance_latest(job.step, sha)
        self._retention(in_flight=job.step)
        return self._info(job.step, manifest, sha)

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
                self._latest_etag = _write(self.store, LATEST, body, if_match=self._latest_etag)
        except PreconditionFailed:
            if self.store.read_bytes(LATEST) != body:  # not just our own retried request landing twice
                raise BadInput(f"{self.store.uri_for(LATEST)} was changed by another writer; "
                               f"refusing to interleave histories") from None
            self._latest_etag = self.store.etag(LATEST)

    # ------------------------------------------------------------------ retention
    def _retention(self, in_flight: int | None) -> None:
        keys = self.store.list(PREFIX + "/")
        dirs: dict[int, set[str]] = {}
        pinned: set[int] = set()
        for k in keys:
            parts = k.split("/")
            if len(parts) >= 3 and (m := _STEP_DIR.match(parts[1])):
                dirs.setdefault(int(m.group(1)), set()).add(k)
            elif k.startswith(PINS + "/") and (p := _parse_pin(k)):
                pinned.add(p[0])
        committed = sorted(s for s, ks in dirs.items() if f"{step_key(s)}/{MANIFEST}" in ks)
        keep = set(committed[-self.keep_last:]) if self.keep_last > 0 else set(committed)
        keep |= pinned
        if in_flight is not None:
            keep.add(in_flight)
        latest = _read_json(self.store, LATEST)
        if latest and isinstance(latest.get("step"), int):
            keep.add(latest["step"])
        if self.keep_best and self.best_metric:
            scored = []
            for s in committed:
                try:
                    value = self._manifest(s).get("metrics", {}).get(self.best_metric)
                except (CorruptCheckpoint, FileNotFoundError):
                    continue
                if value is not None:
                    scored.append((float(value) if self.mode == "min" else -float(value), -s))
            keep |= {-neg for _, neg in sorted(scored)[: self.keep_best]}
        for s in sorted(dirs):
            if s in keep:
                continue
            manifest = f"{step_key(s)}/{MANIFEST}"
            if manifest in dirs[s]:
                self.store.delete(manifest)  # uncommit first: a crash from here leaves plain debris
            self.store.delete_many(sorted(dirs[s] - {manifest}))
            self._manifests.pop(s, None)

    # ------------------------------------------------------------------ locate & verify
    def _locate(self) -> CheckpointInfo | None:
        tried: set[int] = set()
        pointer = _read_json(self.store, LATEST)
        inflight = _read_json(self.store, INFLIGHT)
        p = pointer.get("step") if pointer else None
        q = inflight.get("step") if inflight else None
        if isinstance(q, int) and (not isinstance(p, int) or q > p):
            tried.add(q)  # committed after the pointer was last advanced (a crash in between)?
            if (info := self._verify_quiet(q)) is not None:
                return info
        if isinstance(p, int):
            tried.add(p)
            info = self._verify_quiet(p)
            if info is not None and info.manifest_sha256 == pointer.get("manifest_sha256"):
                return info
        for step in reversed(self._step_dirs()):
            if step in tried:
                continue
            if (info := self._verify_quiet(step)) is not None:
                return info
        return None

    def _step_dirs(self, store: Store | None = None) -> list[int]:
        return checkpoint_steps(store or self.store)

    def _manifest(self, step: int, store: Store | None = None) -> dict[str, Any]:
        store = store or self.store
        key = f"{step_key(step)}/{MANIFEST}"
        try:
            raw = store.read_bytes(key)
        except FileNotFoundError:
            raise CorruptCheckpoint(f"{store.uri_for(step_key(step))} has no {MANIFEST} (not committed)") from None
        try:
            manifest = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            raise CorruptCheckpoint(f"{store.uri_for(key)} is not valid JSON") from None
        if not isinstance(manifest, dict) or manifest.get("step") != step or not isinstance(manifest.get("files"), dict):
            raise CorruptCheckpoint(f"{store.uri_for(key)} is not a manifest of step {step}")
        if manifest.get("format_version") != FORMAT_VERSION:
            raise CorruptCheckpoint(f"{store.uri_for(key)} has format_version {manifest.get('format_version')!r}; "
                                    f"this relaunch reads version {FORMAT_VERSION}")
        manifest["_sha256"] = hashlib.sha256(raw).hexdigest()
        return manifest

    def _info(self, step: int, manifest: dict[str, Any], sha: str | None = None,
              store: Store | None = None) -> CheckpointInfo:
        store = store or self.store
        return CheckpointInfo(step=step, uri=store.uri_for(step_key(step)), key=step_key(step),
                              epoch=int(manifest.get("epoch", 0)), world_size=int(manifest.get("world_size", 1)),
                              created_at=str(manifest.get("created_at", "")),
                              metrics=dict(manifest.get("metrics") or {}),
                              manifest_sha256=sha or manifest.get("_sha256", ""))

    def _verify(self, step: int, store: Store | None = None) -> CheckpointInfo:
        store = store or self.store
        manifest = self._manifest(step, store)
        self._materialize(step, manifest, store=store, verified=False)
        return self._info(step, manifest, store=store)

    def _verify_quiet(self, step: int) -> CheckpointInfo | None:
        try:
            return self._verify(step)
        except (CorruptCheckpoint, FileNotFoundError):
            return None

    def _materialize(self, step: int, manifest: dict[str, Any], *, store: Store, verified: bool) -> Path:
        """A local directory holding the verified files of ``step`` (the store itself for a filesystem,
        a download for S3). Every file's size and sha256 are checked unless this process already did."""
        key = step_key(step)
        files: dict[str, dict[str, Any]] = manifest["files"]
        for name in files:
            if "/" in name or name in ("", ".", ".."):
                raise CorruptCheckpoint(f"{store.uri_for(key)}/{MANIFEST} names an invalid file {name!r}")
        if isinstance(store, FileStore) and type(store) is FileStore:
            local = store.path(key)
            paths = {name: local / name for name in files}
        else:
            local = self._cache / f"load-{step:012d}-{manifest['_sha256'][:16]}"
            marker = local / ".verified"
            if marker.exists():
                return local
            local.mkdir(parents=True, exist_ok=True)
            paths = {}
            for name in files:
                try:
                    store.download_file(f"{key}/{name}", local / name)
                except FileNotFoundError:
                    raise CorruptCheckpoint(f"{store.uri_for(key)}/{name} is missing") from None
                paths[name] = local / name
            verified = False
        if not verified:
            signatures = {}
            for name, path in paths.items():
                if not path.is_file():
                    raise CorruptCheckpoint(f"{store.uri_for(key)}/{name} is missing")
                signatures[name] = _file_signature(path)
                if signatures[name][2] != files[name].get("size"):
                    raise CorruptCheckpoint(f"{store.uri_for(key)}/{name} has {signatures[name][2]} bytes, "
                                            f"the manifest says {files[name].get('size')} (truncated?)")
            # latest() then load() in one process must not hash the same bytes twice: the digests are
            # reused while every file is the very same inode with the same size, mtime and ctime
            # (any write changes ctime) as when it was hashed.
            done = (str(local), manifest["_sha256"])
            if self._verified.get(done) != signatures:
                actual = _hash_files(paths)
                for name, meta in files.items():
                    if actual[name]["sha256"] != meta.get("sha256"):
                        raise CorruptCheckpoint(f"{store.uri_for(key)}/{name} does not match its sha256 in the manifest")
                if all(_file_signature(path) == signatures[name] for name, path in paths.items()):
                    self._verified[done] = signatures
        if not (isinstance(store, FileStore) and type(store) is FileStore):
            (local / ".verified").write_text(manifest["_sha256"])
        return local

    # ------------------------------------------------------------------ load
    def _check_fingerprint(self, info: CheckpointInfo, manifest: dict[str, Any], state: Any) -> None:
        mine = self.model_fingerprint
        if mine is None and hasattr(state, "model"):
            from components.core.state import model_fingerprint

            mine = model_fingerprint(state.model)
        theirs = manifest.get("model_fingerprint")
        if mine and theirs and mine != theirs:
            raise BadInput(f"checkpoint of another model: {info.uri} was written for model {theirs}, "
                           f"this model is {mine} (wrong store URI or model config?)")

    def _dcp_load(self, state: Any, local: Path, info: CheckpointInfo) -> None:
        import torch
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.stateful import Stateful

        metadata = read_metadata(local)
        stored = set(metadata.state_dict_metadata)
        wrapped = hasattr(state, "state_dict") and hasattr(state, "load_state_dict") and not isinstance(state, dict)
        template = state.state_dict() if wrapped else dict(state)
        if isinstance(template.get("rng"), dict):  # another world size: a rank's stream may be absent
            for name in list(template["rng"]):
                if not any(k.startswith(f"rng.{name}.") for k in stored):
                    del template["rng"][name]
            if not template["rng"]:
                del template["rng"]
        try:
            dcp.load(template, storage_reader=_safe_reader(local), planner=_safe_load_planner(),
                     process_group=self._group)
        except CorruptCheckpoint:
            raise
        except (Exception, CheckpointException) as err:  # DCP wraps per-rank errors (a BaseException)
            for failure in getattr(err, "failures", {}).values():
                original = failure[0] if isinstance(failure, tuple) else failure
                if isinstance(original, RelaunchError):
                    raise original from None
            text = str(err)
            if "CorruptCheckpoint" in text or "weights_only" in text or "unsafe" in text:
                raise CorruptCheckpoint(f"{info.uri}: {text.splitlines()[0][:300]}") from None
            if "Missing key" in text or "size" in text or "mismatch" in text:
                raise BadInput(f"checkpoint of another model: {info.uri} does not fit this state "
                               f"({text.splitlines()[0][:200]})") from None
            raise
        if wrapped:
            state.load_state_dict(template)
        else:
            for k, v in template.items():
                if isinstance(state.get(k), Stateful) and not isinstance(state[k], torch.Tensor):
                    pass  # DCP called load_state_dict on it already
                else:
                    state[k] = v

    # ------------------------------------------------------------------ misc
    def _pin_key(self, step: int, reason: str) -> str:
        slug = re.sub(r"[^A-Za-z0-9._-]+", "-", reason).strip("-")[:100]
        if not slug:
            raise BadInput(f"pin reason {reason!r} must contain letters or digits")
        return f"{PINS}/step-{step:012d}--{slug}.json"

    def _guard(self) -> None:
        if self._closed:
            raise RuntimeError("CheckpointManager is closed")


def _parse_pin(key: str) -> tuple[int, str] | None:
    m = re.match(r"^.*/step-(\d{12})--(.+)\.json$", key)
    return (int(m.group(1)), m.group(2)) if m else None


def _portable(err: BaseException) -> tuple[str, str]:
    return type(err).__name__, str(err)


def _read_json(store: Store, key: str) -> dict[str, Any] | None:
    try:
        value = json.loads(store.read_bytes(key))
    except FileNotFoundError:
        return None
    except (ValueError, UnicodeDecodeError):
        return None
    return value if isinstance(value, dict) else None


def _write(store: Store, key: str, data: bytes, *, if_match: str | None) -> str | None:
    etag = store.write_bytes(key, data, if_match=if_match)
    return etag if isinstance(etag, str) else store.etag(key)


def checkpoint_steps(store: Store) -> list[int]:
    """Step numbers of every ``step-*`` directory in ``store`` (committed or not), ascending."""
    steps = []
    for entry in store.list(PREFIX + "/", recursive=False):
        m = _STEP_DIR.match(entry.rstrip("/").rsplit("/", 1)[-1])
        if m and entry.endswith("/"):
            steps.append(int(m.group(1)))
    return sorted(steps)
