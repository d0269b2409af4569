"""The trainer's side of its checkpoints: when it saves (:class:`SaveCadence`) and how
(:class:`TrainerCheckpoints`: evaluate, then save; the commits of background saves recorded in the
attempt record and tagged on the MLflow run; the last save on preemption when it fits the grace).

A save that fails because the store cannot be written (full, read-only: see
:func:`~relaunch.components.core.contract.classify.is_store_unwritable`) does not stop the training: every rank
has the same error (the save's steps agree on it), rank 0 says so in one line, and the next
checkpoint point tries again; ``train.store_unwritable_saves`` failures in a row, or a failed last
save (the training's end has no next point), stop it with :class:`StoreUnwritable` (exit 2). The
last committed checkpoint is untouched: the failed save removed what it wrote.
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Any, Callable, Iterator

from .health import save_fits_grace
from ..contract.classify import as_error, is_store_unwritable, unwritable_cause
from ..contract.errors import StoreUnwritable
from ..contract.events import Kind, emit
from ..runtime import distributed as distr
from .metrics_file import write_validation
from ..store import UNWRITABLE_ADVICE


def say_store(line: str) -> None:
    """One line about the store on this rank's stderr (the pod's log) and, as a ``store`` event, on the
    console of ``relaunch run``."""
    print(f"relaunch: {line}", file=sys.stderr, flush=True)
    emit(Kind.STORE, line=line)


class SaveCadence:
    """Every ``train.checkpoint_every_steps`` steps, at each epoch's end (``train.checkpoint_at_epoch_end``),
    and every ``train.checkpoint_every_seconds`` of rank 0's clock (the ranks agree on that one in the
    step's all-reduce, so every rank saves at the same step). Never at the last step: the end of the
    training saves that one."""

    def __init__(self, train, steps_per_epoch: int, total_steps: int, *, keeps_time: bool):
        self.every_steps = train.checkpoint_every_steps
        self.every_seconds = train.checkpoint_every_seconds if keeps_time else None
        self.at_epoch_end = train.checkpoint_at_epoch_end
        self.steps_per_epoch, self.total_steps = steps_per_epoch, total_steps
        self.last_save = time.monotonic()

    def time_due(self) -> bool:
        """This rank's clock says a save is due (only the rank that keeps the time ever says so)."""
        return self.every_seconds is not None and time.monotonic() - self.last_save >= self.every_seconds

    def wanted(self, step: int, time_due: bool) -> bool:
        """Whether to save after ``step`` (``time_due``: what the ranks agreed on)."""
        epoch_end = self.at_epoch_end and step % self.steps_per_epoch == 0
        every = self.every_steps and step % self.every_steps == 0
        return bool(time_due or epoch_end or every) and step < self.total_steps

    def restart_clock(self) -> None:
        self.last_save = time.monotonic()


class TrainerCheckpoints:
    """Evaluate-then-save at the cadence, on every rank, and the bookkeeping of commits (rank 0)."""

    def __init__(self, config, env, manager, state, tracker, log, attempt: int,
                 evaluate_split: Callable[[], dict[str, float]], peers: Callable[[], Any],
                 steps_per_epoch: int, total_steps: int):
        self.t = config.train
        self.env, self.manager, self.state = env, manager, state
        self.tracker, self.log, self.attempt = tracker, log, attempt
        self.evaluate_split, self.peers = evaluate_split, peers
        self.cadence = SaveCadence(config.train, steps_per_epoch, total_steps, keeps_time=env.is_main)
        self.last_saved = -1
        self.last_committed = None  # CheckpointInfo of the newest committed checkpoint known here
        self.overhead = 0.0  # checkpoint stall + evaluation, this attempt
        self._pending: dict[int, tuple[float, float]] = {}  # rank 0: step -> (done at, overhead then)
        self.store_uri = config.store.uri
        self.unwritable_limit = config.train.store_unwritable_saves
        self.failed_saves: list[int] = []  # the steps whose saves failed in a row, the store unwritable
        self._saving: int | None = None  # the step of the save in flight (its failure names it)

    def close(self, *, after_failure: bool = False) -> None:
        """Wait for the pending save and release the store. After a failure this lets an in-flight save
        of a good state finish, and an error closing is only printed: the first error wins."""
        try:
            self.manager.close()
        except Exception as err:  # noqa: BLE001 - cleanup after a failure; the first error wins
            if not after_failure:
                raise
            print(f"relaunch: closing the checkpoint manager: {err}", file=sys.stderr)
            return
        # the save pending at close committed there: the summary and the attempt record written next
        # must name it (they said step 19 while the next attempt resumed from step 20)
        committed = self.manager.wait()
        if committed is not None and (self.last_committed is None or committed.step > self.last_committed.step):
            self.last_committed = committed
            if self.env.is_main and self.log:
                self.log.record.last_committed_step = max(self.log.record.last_committed_step, committed.step)

    def rejoin(self, manager, state, restored, attempt: int) -> None:
        """After an in-place recovery: the new group's ``manager``, the ``state`` it saves, the step
        ``restored`` (a :class:`~relaunch.components.core.recovery.start.Restored`); a save pending
        when the peer died was given up with the old manager."""
        self.manager, self.state, self.attempt = manager, state, attempt
        self._saving = None
        if restored.step in self._pending and self.log:  # it committed; the old manager died before it said so
            done_at, overhead = self._pending[restored.step]
            self.log.committed(restored.step, done_at, overhead)
        self._pending.clear()
        if restored.committed is not None:
            self.last_committed = restored.committed
        self.last_saved = restored.step
        self.cadence.restart_clock()

    def evaluate(self) -> dict[str, float]:
        """Validation metrics (``val_*``), timed as overhead."""
        began = time.perf_counter()
        with self.peers():  # under FSDP the forward gathers parameters from the other ranks
            metrics = {f"val_{k}": v for k, v in self.evaluate_split().items()}
        spent = time.perf_counter() - began
        self.overhead += spent
        if self.log:
            self.log.record.eval_seconds += spent
        return metrics

    def save(self, step: int, *, wait: bool = False, final: bool = False) -> None:
        """Checkpoint ``step`` (a no-op if it is already saved); ``wait`` until it is committed;
        ``final``: the training's last save, whose failure stops it (no later save tries again)."""
        if step == self.last_saved:
            if wait:
                self.note_commit(last=final)
            return
        metrics = self.evaluate()
        if self.env.is_main:
            emit(Kind.SAVING, step=step, attempt=self.attempt)
            write_validation(step, metrics)  # a tuner's intermediate values ($RELAUNCH_METRICS_FILE)
        self.tracker.log_evaluation(step, metrics, before_checkpoint=True)
        began, step_done_at = time.perf_counter(), time.time()
        self.note_commit()  # the previous async save commits here (save() waits too)
        with self.peers():
            self.manager.save(step, self.state, metrics=metrics, epoch=self.state.epoch, defer_copy=True)
        self._saving = step
        if self.env.is_main:
            self._pending[step] = (step_done_at, self.overhead)
        if wait:
            self.note_commit(last=final)
        stall = time.perf_counter() - began
        self.overhead += stall
        self.last_saved = step
        if self.log:
            self.log.record.stall_seconds += stall
        self.cadence.restart_clock()

    @contextlib.contextmanager
    def stalling(self) -> Iterator[None]:
        """Around the training thread's checkpointing outside a save (a memory snapshot): its time is
        checkpoint stall."""
        began = time.perf_counter()
        try:
            yield
        finally:
            seconds = time.perf_counter() - began
            self.overhead += seconds
            if self.log:
                self.log.record.stall_seconds += seconds

    def wait_for_snapshot(self) -> None:
        """Call before the optimizer step: an async save may still be copying the parameters and
        optimizer state it changes. The time blocked is checkpoint stall."""
        blocked = self.manager.wait_for_snapshot()
        self.overhead += blocked
        if self.log:
            self.log.record.stall_seconds += blocked

    def note_commit(self, *, last: bool = False) -> bool:
        """Wait for the pending save; record and tag it once committed (an async save commits while
        the next steps run). Whether it committed: a save that failed because the store cannot be
        written is counted and said once (:meth:`_unwritable`); ``last``: no later save will try
        again, so that failure stops the training."""
        try:
            with self.peers():
                latest = self.manager.wait()
        except Exception as err:  # noqa: BLE001 - classified: anything but an unwritable store is raised
            if not is_store_unwritable(err):
                raise
            self._unwritable(err, last=last)
            return False
        saving, self._saving = self._saving, None
        if latest is None or saving is None and self.failed_saves or saving is not None and latest.step != saving:
            return False  # nothing committed since the last failure
        if self.failed_saves and self.env.is_main:
            say_store(f"the store {self.store_uri} can be written again: checkpoint of step {latest.step} committed")
        self.failed_saves = []
        self.last_committed = latest
        if not self.env.is_main:
            return True
        done_at, overhead = self._pending.pop(latest.step, (time.time(), self.overhead))
        self.log.committed(latest.step, done_at, overhead)
        self.tracker.checkpoint_committed(latest)
        return True

    def _unwritable(self, err: BaseException, *, last: bool) -> None:
        """The pending save failed, the store cannot be written: the first failure of a row is said
        on rank 0 (one line) and the training goes on; the ``unwritable_limit``-th in a row, or a
        failure of the ``last`` save, raises :class:`StoreUnwritable` on every rank alike."""
        step, self._saving = self._saving, None
        self._pending.pop(step, None)
        self.failed_saves.append(step if step is not None else -1)
        origin = unwritable_cause(err)  # the OSError itself, also where a library wrapped it
        cause = origin.strerror if origin is not None and origin.strerror else str(as_error(err))
        kept = (f"step {self.last_committed.step}, the last committed checkpoint, is intact"
                if self.last_committed is not None else "no checkpoint of this training is committed")
        if last or len(self.failed_saves) >= self.unwritable_limit:
            # the most important first: a launcher may show only the line's first few hundred characters
            failed = (f"saves of steps {', '.join(str(s) for s in self.failed_saves)} failed in a row"
                      if len(self.failed_saves) > 1 else f"the save of step {self.failed_saves[0]} failed")
            raise StoreUnwritable(
                f"store {self.store_uri} cannot be written ({cause}); {kept}: free space or make it writable, then "
                f"resume it (`relaunch run --resume`; on a cluster, submit it again); {failed}") from None
        if len(self.failed_saves) == 1 and self.env.is_main:
            say_store(f"checkpoint of step {step} not saved: store {self.store_uri} cannot be written ({cause}); "
                      f"{kept}; training goes on and saves again at its next checkpoint (it stops after "
                      f"{self.unwritable_limit} failed saves in a row; {UNWRITABLE_ADVICE})")

    def save_on_preemption(self, step: int, grace_left_seconds: float) -> bool:
        """Save ``step`` if rank 0 finds that a save fits the grace left (every rank gets its answer),
        else only let the pending save commit; whether it saved."""
        fits = True
        if self.env.is_main:
            last_save = float(getattr(self.manager, "last_save_seconds", 0.0) or 0.0)
            fits = save_fits_grace(last_save, grace_left_seconds)
        with self.peers():
            fits = distr.broadcast_object(fits)
        if not fits:
            self.note_commit()
            return False
        self.save(step, wait=True)
        return self.last_committed is not None and self.last_committed.step == step
