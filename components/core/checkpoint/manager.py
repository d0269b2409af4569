"""The checkpoint life cycle of one training: save, commit, locate, load, retention.

    with CheckpointManager("s3://bucket/exp/run", keep_last=3, keep_best=1, best_metric="val_loss") as mgr:
        info = mgr.load(state)                 # newest committed checkpoint, resharded to this world
        mgr.save(step, state, metrics={...})   # every rank; returns once the state is snapshotted to CPU
        mgr.wait()                             # the pending save is committed (or its error is raised)

    A trainer may overlap the copy of the parameters and optimizer state with the next step:
        mgr.save(step, state, defer_copy=True) # returns once the copy is started
        forward_backward()                     # only reads what the background thread copies
        mgr.wait_for_snapshot()                # before anything else changes them in place; state.optimizer's
                                               # step() waits by itself (a step pre-hook)

Every rank writes its own DCP shards straight into the store and reads only the items its load plan
names (``dcp_io``); the manifest, the commit point, carries a digest of every chunk, checked as the
bytes arrive. The commit protocol and the layout are in ``docs/checkpoint-format.md``. Under
``torch.distributed`` the manager makes its own gloo group (and one per node, for replicated state),
so a background save's collectives never interleave with the training process group.
"""

from __future__ import annotations

import atexit
import os
import sys
import warnings
import weakref
from typing import Any

from .commit import Committer
from .layout import CheckpointInfo, pin_key
from .write_lease import Lease, default_owner
from .leases import Leases
from .load import Loader, source_of
from .locator import Locator
from .ranks import Ranks
from .retention import Retention
from ..store import Store, open_store

# A single process is a supported use (tests, evaluation, the CLI): DCP's note about it is noise.
warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled, unavailable or uninitialized")


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
            $TORCHELASTIC_RUN_ID, else host:pid). Who may take a lease over: :mod:`write_lease`.
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

    The manager wires collaborators that each own their state and work alone on a store:
    :class:`~relaunch.components.core.checkpoint.ranks.Ranks` (the collectives),
    :class:`~relaunch.components.core.checkpoint.leases.Leases` (write and read leases, the heartbeat),
    :class:`~relaunch.components.core.checkpoint.locator.Locator` (latest, list, best, verify, pins, damage),
    :class:`~relaunch.components.core.checkpoint.load.Loader`,
    :class:`~relaunch.components.core.checkpoint.retention.Retention` and
    :class:`~relaunch.components.core.checkpoint.commit.Committer` (save, commit, latest.json, retention). A
    public method checks here, once, that the manager is open (and waits for the pending save where
    its answer depends on it), then asks its collaborator.
    """

    def __init__(self, store: str | Store, *, keep_last: int = 3, keep_best: int = 0,
                 best_metric: str | None = None, mode: str = "min", async_save: bool = True,
                 process_group: Any = None, owner: str | None = None, lease_seconds: float = 300,
                 model_fingerprint: str | None = None, cache_dir: str | os.PathLike | None = None,
                 ranks_per_node: int | None = None, lease_wait_seconds: float | None = None):
        Retention.check(keep_last=keep_last, keep_best=keep_best, best_metric=best_metric, mode=mode)
        self.store: Store = open_store(store) if isinstance(store, str) else store
        self.retention = Retention(self.store, keep_last=keep_last, keep_best=keep_best, best_metric=best_metric,
                                   mode=mode)
        self.async_save = async_save
        self.owner = owner or default_owner()
        self.lease_seconds = float(lease_seconds)
        self.ranks = Ranks.of_this_process(process_group, ranks_per_node)
        self.leases = Leases(self.store, self.owner, lease_seconds, wait_seconds=lease_wait_seconds)
        self.locator = Locator(self.store, self.leases, rank=self.ranks.rank)
        self.loader = Loader(self.locator, self.ranks, model_fingerprint=model_fingerprint, cache_dir=cache_dir)
        self.committer = Committer(self.store, self.ranks, self.leases, self.locator, self.retention,
                                   async_save=async_save, model_fingerprint=model_fingerprint)
        self._lease_checked = False
        self._closed = False
        _OPEN.add(self)

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

    # ------------------------------------------------------------------ what callers read
    @property
    def group(self) -> Any:
        """The manager's own gloo process group (None without ``torch.distributed``): the group of
        its collectives, e.g. :func:`~relaunch.components.core.runtime.distributed.agree` of a rank-0 decision."""
        return self.ranks.group

    @property
    def rank(self) -> int:
        """This process's rank in :attr:`group` (0 for a single process)."""
        return self.ranks.rank

    @property
    def world_size(self) -> int:
        """The size of :attr:`group` (1 for a single process)."""
        return self.ranks.world_size

    @property
    def lease(self) -> Lease:
        """The store's write lease, as this manager holds it (or not yet)."""
        return self.leases.lease

    @property
    def keep_last(self) -> int:
        return self.retention.keep_last

    @property
    def keep_best(self) -> int:
        return self.retention.keep_best

    @property
    def best_metric(self) -> str | None:
        return self.retention.best_metric

    @property
    def mode(self) -> str:
        return self.retention.mode

    @property
    def model_fingerprint(self) -> str | None:
        """The fingerprint the saves write (given, or computed at the first save)."""
        return self.committer.model_fingerprint

    @property
    def last_save_seconds(self) -> float | None:
        """Seconds the last committed save took, from its call to its commit."""
        return self.committer.last_save_seconds

    @property
    def save_in_flight(self) -> bool:
        """True while a background save started by :meth:`save` has not ended (committed or failed)."""
        return self.committer.in_flight

    @property
    def stall_seconds_total(self) -> float:
        """Seconds the training waited on saves (snapshots, deferred copies, waits)."""
        return self.committer.stall_seconds_total

    # ------------------------------------------------------------------ public API
    def save(self, step: int, state: Any, metrics: dict | None = None, epoch: int = 0, *,
             defer_copy: bool = False) -> None:
        """Snapshot ``state`` to CPU and persist it as checkpoint ``step`` (every rank calls it).

        Returns once the snapshot is taken (async) or the checkpoint is committed (sync): training may
        change the state the moment it returns. With ``defer_copy`` (async only) it returns sooner: the
        small state (counters, RNG, scheduler, scaler, buffers) is copied here, and the model parameters
        and optimizer state are copied by the background thread while the caller runs the next forward
        and backward, which only read them. The next ``step()`` of the state's optimizers waits for that
        copy by itself (a step pre-hook); anything else that changes them in place must call
        :meth:`wait_for_snapshot` first. Raises the error of the previous background save, if it
        failed, and BadInput when another writer holds the store's lease.
        """
        self._guard()
        self.committer.save(step, state, metrics, epoch, defer_copy=defer_copy,
                            take_lease=None if self._lease_checked else self.take_lease, keep_alive=self)

    def wait_for_snapshot(self) -> float:
        """Block until the pending save has copied the state it saves; return the seconds blocked.

        ``save(..., defer_copy=True)`` copies the model parameters and optimizer state on its
        background thread, overlapped with the next step's forward and backward (which only read
        them). Call this right before anything changes them in place; the step of an optimizer the
        saved state names calls it itself (a step pre-hook), and save(), wait(), load() and close()
        wait for the copy too. With no deferred copy pending it returns 0.0 at once.
        """
        return self.committer.wait_for_snapshot()

    def wait(self) -> CheckpointInfo | None:
        """Block until the pending save is committed and return its info (with no save pending: the
        info of the last save this manager committed, or None); raise the pending save's error."""
        return self.committer.wait()

    def latest(self) -> CheckpointInfo | None:
        """The newest committed checkpoint that is not quarantined, whose manifest parses and matches
        its own digest and whose files all exist with their sizes, or None (rank 0 decides; O(1)
        requests, no data read: the bytes are checked by the read that loads them). A checkpoint
        found damaged on the way is quarantined (docs/checkpoint-format.md, "Quarantine")."""
        self._guard()
        self.wait()
        return self.ranks.agree(self.ranks.rank0(self.locator.latest))

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
            store, step = source_of(uri, self.store)
        info = self.loader.load(state, store, step)
        if info is not None and store is self.store:
            self.committer.forget_latest_pointer()
        return info

    def list(self) -> list[CheckpointInfo]:
        """Every intact committed checkpoint, oldest first: its manifest matches its digest, every
        file it lists exists with its size, it is not quarantined (no data read). One found damaged
        here is quarantined and left out: :meth:`quarantined` lists those."""
        self._guard()
        return self.locator.list()

    def quarantined(self) -> list[dict[str, Any]]:
        """The damaged checkpoints of the store, by step: each quarantine record (``step``,
        ``reason``, ``found_at``, ``found_by``, ``manifest_sha256``; ``moved_to``: None while the
        checkpoint is still in its step directory, else the folder it was moved aside to), plus
        damage this process found but could not record in the store (``"recorded": False``)."""
        self._guard()
        return self.locator.quarantined()

    def verify(self, step: int, deep: bool = True) -> CheckpointInfo:
        """Check checkpoint ``step`` against its manifest: with ``deep`` every byte (format 1: each
        file's sha256; formats 2 and 3: every chunk digest), else that every file exists with its size.

        A checkpoint found damaged is quarantined; one quarantined before is reported as such.

        Raises:
            CorruptCheckpoint: missing, malformed or altered manifest, a missing, truncated or
                altered file, or a quarantined checkpoint.
            BadInput: a checkpoint of a newer format.
        """
        self._guard()
        return self.locator.verify(step, deep)

    def best(self, metric: str | None = None, mode: str | None = None) -> CheckpointInfo | None:
        """The committed checkpoint with the best ``metric`` (default: ``best_metric``/``mode``) whose
        files are all there; ties go to the newer step; None when no checkpoint has the metric."""
        self._guard()
        return self.locator.best(metric or self.retention.best_metric, mode or self.retention.mode)

    def pin(self, step: int, reason: str) -> None:
        """Protect committed checkpoint ``step`` from retention until unpinned with the same reason."""
        self._guard()
        self.locator.pin(step, reason)

    def unpin(self, step: int, reason: str) -> None:
        """Remove the pin ``reason`` of ``step`` (no error if it was not pinned)."""
        self._guard()
        self.store.delete(pin_key(step, reason))

    def pins(self) -> dict[int, list[str]]:
        """Pinned steps and their reasons."""
        return self.locator.pins()

    def take_lease(self) -> None:
        """Take the store's write lease now (every rank calls it; rank 0 takes it), start its
        heartbeat and abort the multipart uploads a killed writer left. A trainer calls it before it
        trains, so that a second run is refused before it does any work; ``save`` calls it otherwise.

        Raises:
            BadInput: another writer holds the lease (one line; see :mod:`write_lease` for who may take it).
        """
        self._guard()
        self.ranks.agree(self.ranks.rank0(self._take_lease))
        self._lease_checked = True

    def close(self) -> None:
        """Wait for the pending save, release the write and read leases; idempotent. Raises the
        pending save's error."""
        if self._closed:
            return
        self._closed = True
        _OPEN.discard(self)
        try:
            self.committer.close()
        finally:
            self.leases.close(release=self.ranks.rank == 0)
            self.loader.close()

    def on_snapshot(self, callback: Any) -> None:
        """Call ``callback(step, snapshot)`` with each save's CPU snapshot once it is copied, on a thread
        beside the save's writes, which the save's end waits for (the memory tier keeps it); its failure
        is printed, never the save's."""
        self.committer.on_snapshot = callback

    def abandon(self, wait_seconds: float = 30.0) -> None:
        """Close after the process group broke under the manager (a peer was killed and the survivors
        recover in place): the pending save, whose collectives cannot complete, is given up (its thread
        waited for up to ``wait_seconds``, its error not raised), the leases released (rank 0); the
        survivors open a new manager over the new group."""
        if self._closed:
            return
        self._closed = True
        _OPEN.discard(self)
        try:
            self.committer.abandon(wait_seconds)
        finally:
            self.leases.close(release=self.ranks.rank == 0)
            self.loader.close()

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _take_lease(self) -> None:
        """Rank 0: the lease, then the pointer the next commit advances conditionally."""
        self.leases.take()
        self.committer.read_latest_pointer()

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
