"""Saving and committing: the snapshot job, every rank's DCP write, the preflight (a damaged
checkpoint of the same step is moved aside first), the commit point (the manifest), advancing
``latest.json``, then retention.

    leases = Leases(store, owner="run-1", seconds=300)
    committer = Committer(store, Ranks(), leases, Locator(store, leases), Retention(store, keep_last=3))
    committer.save(7, state, take_lease=leases.take)
    info = committer.wait()            # committed (or the save's error raised)
"""

from __future__ import annotations

import hashlib
import json
import sys
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable

from . import load as reading
from . import quarantine, save_process
from .fingerprint import model_fingerprint
from .layout import (FORMAT_VERSION, INFLIGHT, LATEST, MANIFEST, CheckpointInfo, info_of,
                     now, read_manifest_bytes, sealed_manifest_body, step_key, versions,
                     write_conditional)
from .leases import Leases
from .locator import Locator
from .ranks import Ranks
from .readers import deletion_done
from .retention import Retention
from .snapshot import Snapshotter, copy_deferred, optimizers_of, state_bytes
from .verify import CHUNK_BYTES, DIGEST
from ..contract.classify import CarriedError, as_error, is_store_unwritable
from ..contract.errors import BadInput, CorruptCheckpoint
from ..store import PreconditionFailed, Store

if TYPE_CHECKING:
    import torch

FILE_BYTES = 64 * 1024 * 1024  # a rank's state is spread over files of about this size (a file is
# the most one ranged read asks for; many files also give S3 parallel uploads and downloads)


def agreed(err: BaseException) -> BaseException:
    """``err``, a failure of this rank's part of a save that every rank of the save has learned (their
    agreement completed), as it is raised on this rank: a ``RuntimeError`` (what torch raises for a
    writer's failure, a bug) becomes the contract's error of its class (:func:`as_error`, raised from
    it), because a caller that waits on peers takes a ``RuntimeError`` for a collective a lost peer
    broke; the peers are alive and end with the same cause. Anything else is raised as it is."""
    if isinstance(err, RuntimeError):
        contract = as_error(err)
        contract.__cause__ = err
        return contract
    return err


def _own(fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` (rank 0's store operations of a save, no collective among them) with its failure
    :func:`agreed` before the ranks agree on it."""
    def run() -> Any:
        try:
            return fn()
        except RuntimeError as err:
            raise agreed(err) from err
    return run


class SaveJob:
    """One save in flight: its snapshot, the copies still to make, and its outcome."""

    def __init__(self, step: int, epoch: int, snapshot: Any, metrics: dict[str, float], started: float):
        self.step, self.epoch, self.snapshot, self.metrics, self.started = step, epoch, snapshot, metrics, started
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (snapshot buffer, live tensor) still to copy
        self.copied = threading.Event()
        self.cuda_ready: torch.cuda.Event | None = None  # recorded after the work the snapshot must see
        self.cuda_device: int | None = None
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.info: CheckpointInfo | None = None


class Committer:
    """Saves and commits the checkpoints of one writer; one save in flight at a time.

    Args:
        store: the store written.
        ranks: the ranks that save together (every rank writes its shards; rank 0 commits).
        leases: the write lease (fenced before the commit point and every deletion) and the read
            leases a save releases.
        locator: checks a step already there (preflight) and the manifests retention counts.
        retention: what to keep after each commit.
        async_save: persist and commit in a background thread (the next save waits for it).
        model_fingerprint: stored in each manifest; computed from ``state.model`` at the first save
            when None.
    """

    def __init__(self, store: Store, ranks: Ranks, leases: Leases, locator: Locator, retention: Retention, *,
                 async_save: bool = True, model_fingerprint: str | None = None):
        self.store, self.ranks, self.leases, self.locator, self.retention = store, ranks, leases, locator, retention
        self.async_save, self.model_fingerprint = async_save, model_fingerprint
        # a background save writes from the process's helper where that is safe (save_process.usable):
        # its CPU work then never holds the GIL the training thread needs
        self.write_in_process = True
        self.last_save_seconds: float | None = None
        self.stall_seconds_total = 0.0
        self._latest_etag: str | None = None
        self._latest_known = False
        self._snapshots = Snapshotter()
        if async_save and save_process.usable(store, ranks.distributed):
            self._snapshots.arena = save_process.SharedArena()  # the buffers the helper reads
        self._step_hooks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> its hook's handle
        self._pending: SaveJob | None = None
        self._last_info: CheckpointInfo | None = None
        # called with (step, its CPU snapshot) once a save's copy is made, on a thread beside the save's
        # writes: the memory tier keeps that snapshot; its failure is said, never the save's
        self.on_snapshot: Callable[[int, Any], None] | None = None

    def save(self, step: int, state: Any, metrics: dict | None = None, epoch: int = 0, *, defer_copy: bool = False,
             take_lease: Callable[[], None] | None = None, keep_alive: Any = None) -> None:
        """Snapshot ``state`` and persist it as checkpoint ``step`` (:meth:`CheckpointManager.save`);
        ``take_lease`` runs first when given (the caller's lease not taken yet); ``keep_alive`` is held
        until a background save ends (the manager: a program that drops it while its last save runs
        still has it closed, the save committed and the lease released, at exit)."""
        t0 = time.perf_counter()
        try:
            self.wait()
            step_key(step)
            if self.model_fingerprint is None and hasattr(state, "model"):
                self.model_fingerprint = model_fingerprint(state.model)
            if take_lease is not None:
                take_lease()  # a second writer is refused right here, if not before training
            if self.ranks.rank == 0:
                self.leases.release_reads()  # what this writer loaded is in its state now
            if epoch == 0 and hasattr(state, "epoch"):
                epoch = int(state.epoch)
            job = SaveJob(step, int(epoch), None, {k: float(v) for k, v in (metrics or {}).items()}, t0)
            deferred = self.async_save and defer_copy
            job.snapshot = self._snapshots.take(state, job.copies if deferred else None)
            for optimizer in optimizers_of(state) if deferred else []:
                self._wait_before_step(optimizer)
            import torch

            if torch.cuda.is_available():
                job.cuda_device = torch.cuda.current_device()  # the background thread's would be device 0
                job.cuda_ready = torch.cuda.Event()
                job.cuda_ready.record()
            self._pending = job
            if self.async_save:
                job.thread = threading.Thread(target=self._run_job, args=(job, keep_alive),
                                              name=f"ckpt-save-{step}", daemon=True)
                job.thread.start()
            else:
                self._run_job(job)
        finally:
            self.stall_seconds_total += time.perf_counter() - t0
        if not self.async_save:
            self.wait()

    @property
    def in_flight(self) -> bool:
        """A background save is pending and its thread has not ended."""
        job = self._pending
        return job is not None and job.thread is not None and job.thread.is_alive()

    def wait_for_snapshot(self) -> float:
        """Block until the pending save has copied the state it saves; return the seconds blocked
        (:meth:`CheckpointManager.wait_for_snapshot`)."""
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
        info of the last save committed here, or None); raise the pending save's error."""
        job, self._pending = self._pending, None
        if job is None:
            return self._last_info
        if job.thread is not None:
            job.thread.join()
        if job.error is not None:
            raise job.error
        self._last_info = job.info
        return job.info

    def read_latest_pointer(self) -> None:
        """Read the etag of ``latest.json`` now (the lease holder, once it holds the lease): the
        next commit advances it by a conditional write on that etag."""
        self._latest_etag = self.store.etag(LATEST)
        self._latest_known = True

    def forget_latest_pointer(self) -> None:
        """Read the etag of ``latest.json`` again before the next commit (after a load)."""
        self._latest_known = False

    def abandon(self, wait_seconds: float) -> None:
        """The process group broke (an in-place recovery): give up the pending save, whose collectives
        cannot complete, waiting up to ``wait_seconds`` for its thread to end (its failure is not
        raised), and stop making optimizers wait for copies."""
        job, self._pending = self._pending, None
        if job is not None and job.thread is not None:
            job.thread.join(wait_seconds)
        for handle in list(self._step_hooks.values()):
            handle.remove()
        self._step_hooks.clear()

    def close(self) -> None:
        """Wait for the pending save (its error raised) and stop making optimizers wait for copies."""
        try:
            self.wait()
        finally:
            for handle in list(self._step_hooks.values()):
                handle.remove()
            self._step_hooks.clear()

    def _wait_before_step(self, optimizer: Any) -> None:
        """Make ``optimizer.step()`` wait for this committer's deferred copy (once per optimizer)."""
        if optimizer in self._step_hooks:
            return
        committer = weakref.ref(self)

        def wait_for_snapshot(*_: Any) -> None:
            owner = committer()
            if owner is not None:
                owner.wait_for_snapshot()

        self._step_hooks[optimizer] = optimizer.register_step_pre_hook(wait_for_snapshot)

    def _run_job(self, job: SaveJob, keep_alive: Any = None) -> None:
        try:
            copy_deferred(job)
            handing = self._hand_over(job)
            try:
                job.info = self._persist(job)
                self.last_save_seconds = time.perf_counter() - job.started
            finally:
                if handing is not None:
                    handing.join()  # the snapshot's memory is the tier's to copy until then
        except BaseException as err:  # noqa: BLE001 - surfaces at the next save()/wait()
            job.error = err
            if self.ranks.rank == 0:  # every rank has the error now (the save's steps agree on it)
                self._discard_failed(job.step, err)
        finally:
            job.snapshot = None

    def _discard_failed(self, step: int, err: BaseException) -> None:
        """Rank 0, after the save of ``step`` failed: remove what it wrote (on a full store that space
        is what the next save needs), unless it got as far as its manifest (committed: locate finds it
        through inflight.json) or the failure says another writer is here (a lost lease, a foreign
        pointer). Best effort: what stays (a read-only store) is debris retention removes later."""
        if isinstance(err, BadInput) or not is_store_unwritable(err):
            return  # any other failure leaves what a crash would leave: the next writer's cleanup is for that
        key = step_key(step)
        try:
            if self.store.exists(f"{key}/{MANIFEST}") or not self.leases.holds():
                return
            self.store.delete_many(self.store.list(key + "/"))
        except Exception:  # noqa: BLE001 - best effort on a sick store; the save's own error is what counts
            pass

    def _hand_over(self, job: SaveJob) -> threading.Thread | None:
        """``on_snapshot`` with the save's copy, beside its writes: the tier holds the saved step while
        the store is still being written (a slow upload would otherwise leave it on an older state,
        which a rank lost during the upload could not be served at), and the commit never waits for
        the tier's hand-over to a peer."""
        if self.on_snapshot is None:
            return None

        def hand_over() -> None:
            try:
                self.on_snapshot(job.step, job.snapshot)
            except Exception as err:  # noqa: BLE001 - the tier is a cache: the store has the save
                print(f"relaunch: memory tier: step {job.step} not kept in memory: {err}", file=sys.stderr, flush=True)

        thread = threading.Thread(target=hand_over, name=f"memory-tier-save-{job.step}", daemon=True)
        thread.start()
        return thread

    def _persist(self, job: SaveJob) -> CheckpointInfo:
        import torch.distributed as dist

        self.ranks.agree(self.ranks.rank0(_own(lambda: self._preflight(job.step))))
        files_per_rank = max(1, -(-state_bytes(job.snapshot) // FILE_BYTES))
        key = step_key(job.step)

        def write() -> dict[str, dict[str, Any]]:
            return save_process.dcp_write(self.store, key, job.snapshot, files_per_rank=files_per_rank,
                                          threads=reading.IO_THREADS, group=self.ranks.group)

        def write_in_helper() -> dict[str, dict[str, Any]]:
            return save_process.helper().write(self._snapshots.arena, job.snapshot, save_process.root_of(self.store),
                                               key, files_per_rank=files_per_rank, threads=reading.IO_THREADS,
                                               what=f"writing step {job.step}", fallback=write)

        # the CPU work of the write off this process's GIL where that is safe (save_process)
        # (the first save of the process starts the helper and writes on this thread meanwhile)
        in_child = (self.async_save and self.write_in_process and self._snapshots.arena is not None
                    and save_process.usable(self.store, self.ranks.distributed) and save_process.helper().ready())
        outcome = self.ranks.catch(write_in_helper if in_child else write)
        if self.ranks.distributed:
            gathered: list[Any] = [None] * self.ranks.world_size
            local = outcome if outcome[0] == "ok" else ("err", CarriedError.of(outcome[1]))
            dist.all_gather_object(gathered, local, group=self.ranks.group)
            if outcome[0] == "err":  # every rank learned it: this rank's own failure, not a broken collective
                raise agreed(outcome[1])
            files: dict[str, Any] = {}
            for r, (kind, value) in enumerate(gathered):
                if kind == "err":
                    raise value.rebuild(f"rank {r}: ")
                files.update(value)
        else:
            if outcome[0] == "err":
                raise outcome[1]
            files = outcome[1]
        return self.ranks.agree(self.ranks.rank0(_own(lambda: self._commit(job, files))))

    def _preflight(self, step: int) -> None:
        self.leases.fence()  # a renewal, off the training thread; a writer taken over stops here
        key = step_key(step)
        if self.store.exists(f"{key}/{MANIFEST}"):
            try:
                self.locator.checked(step)
            except CorruptCheckpoint as err:  # damaged (quarantined now if not before): write it again
                self._move_aside(step, str(err))
            else:
                raise BadInput(f"checkpoint {self.store.uri_for(key)} is already committed; refusing to "
                               f"overwrite it (save a later step)")
        self.store.write_bytes(INFLIGHT, json.dumps({"step": step, "owner": self.leases.owner,
                                                     "started_at": now()}).encode())

    def _commit(self, job: SaveJob, files: dict[str, Any]) -> CheckpointInfo:
        key = step_key(job.step)
        manifest = {
            "format_version": FORMAT_VERSION, "step": job.step, "epoch": job.epoch,
            "world_size": self.ranks.world_size, "created_at": now(), "files": dict(sorted(files.items())),
            "digest": DIGEST, "chunk_bytes": CHUNK_BYTES, "byteorder": sys.byteorder,
            "metrics": job.metrics, "versions": versions(), "model_fingerprint": self.model_fingerprint,
            "owner": self.leases.owner,
        }
        body = sealed_manifest_body(manifest)
        self.leases.fence()  # a writer that lost its lease (stalled past it) commits nothing
        self.store.write_bytes(f"{key}/{MANIFEST}", body)  # the commit point
        manifest["_sha256"] = hashlib.sha256(body).hexdigest()
        self.locator.remember(job.step, body)  # retention does not read it back
        self._advance_latest(job.step, manifest["_sha256"])
        try:
            self.retention.apply(in_flight=job.step, manifest=self.locator.manifest, claim=self.leases.claim,
                                 done=lambda s: deletion_done(self.store, s), listed=self.locator.retained)
        except Exception as err:  # noqa: BLE001 - classified: anything but an unwritable store is raised
            if not is_store_unwritable(err):
                raise
            # the step is committed; retention, which must mark a step before deleting it, deletes
            # nothing until the store takes writes again (the next commit's retention catches up)
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

    def _move_aside(self, step: int, reason: str) -> None:
        """Lease holder, before saving damaged ``step`` again: move the old checkpoint out of the way."""
        try:
            sha = hashlib.sha256(read_manifest_bytes(self.store, step)).hexdigest()
        except CorruptCheckpoint:
            return  # gone meanwhile (a person removed it): nothing to move
        rec = quarantine.find(self.store, step, sha) or {"step": step, "manifest_sha256": sha, "reason": reason,
                                                         "found_at": now(), "found_by": self.leases.owner}
        dest = quarantine.move_aside(self.store, step, rec, moved_by=self.leases.owner)
        self.locator.forget(step)
        print(f"relaunch: damaged checkpoint {self.store.uri_for(step_key(step))} moved aside to "
              f"{self.store.uri_for(dest)}; saving step {step} again", file=sys.stderr, flush=True)
