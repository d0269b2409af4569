"""The training entrypoint every torchrun worker (and every PyTorchJob pod) runs.

    .venv/bin/torchrun --nnodes=1 --nproc-per-node=2 --max-restarts=3 --monitor-interval=0.5 \\
        --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:29400 --rdzv-id=demo \\
        --rdzv-conf=join_timeout=30,last_call_timeout=1,close_timeout=5 --shutdown-timeout=25 \\
        -m relaunch.components.train --config relaunch.yaml --set train.epochs=2

    python -m relaunch.components.train --config-json '{"train": {"max_steps": 20}}'    # a world of one

It resumes by itself: rank 0 finds the latest committed checkpoint of the store (else
``train.resume_from``) and every rank loads it. The data cursor is the global sample index
``step * global_batch_size`` into a seeded per-epoch permutation, each rank taking its slice of the
global batch, so the order after a resume equals an uninterrupted run's at any world size.

SIGTERM and SIGUSR1 only set a flag; the ranks agree on it at the next step boundary (the step's one
all-reduce), save when the last save's duration fits the grace period left, and exit 143. A NaN/inf
loss exits 3 without saving; a hung rank exits 138 (watchdog). Rank 0 alone talks to MLflow, through
a buffered asynchronous logger. Every attempt ending under our control writes ``runs/exit.json`` and
``runs/summary.json`` in the store (see :mod:`relaunch.components.core.store.ledger`). Rank 0 tells its launcher
what happens with the events of :mod:`relaunch.components.core.contract.events` on stdout (``resumed``, ``first-step``
(with the start-up phases), ``progress``, ``saving``, ``summary``, ``exit``). What a first step does
not need (MLflow, psutil, matplotlib) loads after it, off the training thread.
"""

from __future__ import annotations

import gc
import os
import time

_PROCESS_START = time.time()  # before the heavy imports: start-up time is part of goodput

# Start-up allocates the ~300k objects of torch and torch._dynamo (which the first optimiser imports),
# all living as long as the process: the collector's passes over them were ~0.4 s of a cold worker's
# 2.3 s of CPU before its first step. Off until the first step, then what start-up built is frozen out
# of its reach (see release_startup_gc), as the zygote does before it forks.
_GC_HELD = __name__ == "__main__" and gc.isenabled()
if _GC_HELD:
    gc.disable()


def _process_created() -> float:
    """When this process was created (Linux's /proc, 10 ms resolution), else its first line's time:
    the interpreter's own start-up belongs to a restart's "process start" phase. Its age comes from
    the boot clock (/proc/uptime against the start tick); /proc/stat's ``btime`` is whole seconds, which
    put every creation up to 1 s early."""
    try:
        with open("/proc/self/stat") as fh:
            ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as fh:
            age = float(fh.read().split()[0]) - ticks / os.sysconf("SC_CLK_TCK")
        created = time.time() - max(0.0, age)
    except (OSError, ValueError, IndexError):
        return _PROCESS_START
    return created if created <= _PROCESS_START else _PROCESS_START


_PROCESS_CREATED = _process_created()

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from dataclasses import asdict  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from .core.runtime import causes  # noqa: E402
from .core.runtime import distributed as distr  # noqa: E402
from .core.runtime import logs, wiring  # noqa: E402
from .core.data.loader import loader_worker_loss  # noqa: E402
from .core.store import HintWrites, UNWRITABLE_ADVICE, open_store, probe_writable, records
from .core.store import ledger  # noqa: E402
from .core.tracking import goodput  # noqa: E402
from .core.trainer import setup  # noqa: E402
from .core.contract.config import RelaunchConfig  # noqa: E402
from .core.contract.config_loading import config_from_cli  # noqa: E402
from .core.contract import suggestions  # noqa: E402
from .core.contract.errors import Diverged, Preempted, RelaunchError, StoreUnwritable, error_for  # noqa: E402
from .core.contract.classify import as_error, is_store_unwritable  # noqa: E402
from .core.contract.entry import report  # noqa: E402
from .core.contract.events import Kind, emit  # noqa: E402
from .core.contract.exitcodes import PERMANENT, RETRYABLE, ExitCode  # noqa: E402
from .core.tracking.client import tracking_uri
from .core.store.ledger import TrainSummary  # noqa: E402
from .core.trainer.health import PreemptionFlag, SpikeDetector, Watchdog, is_finite  # noqa: E402
from .core.trainer.injection import Injection, wrap_store  # noqa: E402
from .core.recovery import in_place  # noqa: E402
from .core.recovery.in_place import InPlace  # noqa: E402
from .core.recovery.start import start  # noqa: E402
from .core.trainer.saving import TrainerCheckpoints  # noqa: E402
from .core.trainer import progress  # noqa: E402
from .core.trainer.parallel import total_grad_norm
from .core.trainer.sysmetrics import SystemSampler
from .core.trainer.tracking import (CLOSE_SECONDS_FAILED, CLOSE_SECONDS_PREEMPTED,  # noqa: E402
                                    TrainingTracker, resolve_run_id, run_params)
from .tasks.base import load_task  # noqa: E402

_IMPORTED = time.time()


def release_startup_gc() -> None:
    """Give the garbage collector back what start-up held from it (idempotent): what exists now moves to
    its permanent generation, never scanned again (the few start-up cycles among it, ~9k objects, stay),
    and it runs as usual from here on."""
    global _GC_HELD
    if _GC_HELD:
        _GC_HELD = False
        gc.freeze()
        gc.enable()


# A retryable failure (a peer died, torchrun is stopping the group): the system metrics of a dying
# attempt are not worth delaying its restart for.
SYSTEM_METRICS_SECONDS_TOLD_TO_GO = 0.3


class PeerFailure(RelaunchError):
    """A collective broke because another rank went away without a word (SIGKILL, OOM, a lost node): this
    rank is a peer of a killed worker, and the attempt ends as the killed one did, 137 (retryable)."""

    exit_code = ExitCode.KILLED
    kind = "peer-killed"

    def __init__(self, err: BaseException | str):
        """From the collective's error (its text goes to stderr, not into the reason), or, carried from
        another rank, from the message."""
        if isinstance(err, BaseException):
            print(f"relaunch: a collective failed: {str(err).splitlines()[0][:300] if str(err) else type(err).__name__}",
                  file=sys.stderr, flush=True)
            err = PEER_KILLED
        super().__init__(err)


PEER_KILLED = "a peer worker was killed (SIGKILL, OOM or a lost node); the surviving ranks stopped with it"


@contextlib.contextmanager
def waiting_on_peers(world_size: int):
    """Around the calls that wait on the other ranks (DDP's backward all-reduce, our all-reduces and
    broadcasts, the checkpoint manager's agreements). Classified by type and place, never by message
    text: torch's distributed errors (``DistError``, what NCCL and the c10d store raise) anywhere, and
    a ``RuntimeError`` raised here while there are peers (what gloo raises when a peer's socket
    closes), are a :class:`PeerFailure`; our own errors pass unchanged. A ``RuntimeError`` that a dead
    data-loader worker of this rank explains is that (:func:`loader_worker_loss`), not a lost peer."""
    try:
        yield
    except RelaunchError:
        raise
    except (torch.distributed.DistError, RuntimeError) as err:
        lost = loader_worker_loss(err)
        if lost is not None:
            raise lost from err
        if isinstance(err, torch.distributed.DistError) or world_size > 1:
            raise PeerFailure(err) from err
        raise


def local_exit_record(elastic_run_id: str) -> Path:
    """Where a node records how an attempt ended when the store cannot take ``runs/exit.json`` (full,
    read-only): a file of this node, read by the next attempt that the same torchrun starts here
    (torchrun restarts a worker group whatever its exit code)."""
    return Path(tempfile.gettempdir()) / f"relaunch-exit-{elastic_run_id}.json"


def refuse_restart_recorded_locally(env: distr.DistEnv) -> None:
    """The store's :func:`ledger.refuse_permanent_restart` for an ending only this node could record:
    the restarted attempt ends at once with the same code and line (what the launcher shows is the
    cause, not the refusal)."""
    if env.restart_count == 0 or not env.elastic_run_id:
        return
    try:
        record = json.loads(local_exit_record(env.elastic_run_id).read_text())
    except (OSError, ValueError):
        return
    if record.get("exit_code") in PERMANENT:
        raise error_for(record["exit_code"], str(record.get("reason", "")), record.get("kind", ""))


# ------------------------------------------------------------------------------------ the training


class Training:
    """One attempt of the training, on one rank: the loop, and how it ends. What it builds first is
    :mod:`relaunch.components.core.trainer.setup`'s, when and how it saves :class:`TrainerCheckpoints`', tracking
    :class:`TrainingTracker`'s, faults :mod:`relaunch.components.core.trainer.injection`'s, the attempt records
    :mod:`relaunch.components.core.store.ledger`'s."""

    def __init__(self, config: RelaunchConfig):
        self.config = config
        self.t = config.train
        self.env: distr.DistEnv | None = None
        self.device: torch.device | None = None
        self.phases: dict[str, float] = {}
        # built by setup()
        self.store = None
        self.injection: Injection | None = None
        self.task = None
        self.data: setup.TrainData | None = None
        self.parts: setup.ModelParts | None = None
        self.spikes = SpikeDetector(self.t.loss_spike_factor)
        self.checkpoints: TrainerCheckpoints | None = None
        self.inplace: InPlace | None = None  # train.memory_tier under the in-place agent
        self.log: ledger.AttemptLog | None = None  # rank 0's attempt record
        self.tracker = TrainingTracker(config, None, enabled=False, run_id=None, attempt=0)
        self.preempt = PreemptionFlag()
        self.system_metrics = None  # on each node's local rank 0 after the first step: a SystemSampler
        # progress of this attempt
        self.attempt = 0
        self.run_id: str | None = None
        self.step = 0
        self.total_steps = 0
        self.resumed_from = -1
        self.overflows = 0
        self.final_metrics: dict = {}
        self.train_seconds = 0.0
        self.compute_seconds = 0.0  # this attempt's steps, without step_sleep_seconds
        self.steps_done = 0

    # ---- set-up: build everything, then act (each part kept as soon as it exists: fail() cleans up)

    def setup(self) -> None:
        self.env = env = distr.read_env()
        setup.check_world_size(self.config, env.world_size)
        refuse_restart_recorded_locally(env)  # every rank of the node, before any of them waits on another
        distr.init(env, self.t.process_group_timeout_seconds)
        self.phases = {"imports": _IMPORTED - _PROCESS_START, "process_group": time.time() - _PROCESS_START}
        self.device = distr.device(env)
        self.task = load_task(self.t.task, self.config)
        raw_store = open_store(self.config.store.uri)
        ledger.refuse_permanent_restart(raw_store, env.restart_count, env.elastic_run_id)
        self.injection = Injection.for_world(self.config.launch.inject_failure, raw_store, env)
        self.inplace = InPlace.for_worker(self.config, env, raw_store)
        self.store = wrap_store(self.inplace.store if self.inplace else raw_store, self.injection)
        setup.seed(self.config)
        refusal, version = None, self.config.data.version
        if env.is_main:
            # the first writes of the training: a store that cannot take them is refused here, on every
            # rank alike (the answer rides on the broadcast below), before anything is written
            try:
                probe_writable(raw_store)
                version = setup.committed_version(self.config, self.task, raw_store)  # a worker started by hand
                record = ledger.claim_attempt(self.store, _PROCESS_START, env.world_size, created=_PROCESS_CREATED)
                self.log = ledger.AttemptLog(HintWrites(self.store), record)
                self.attempt = record.attempt
                self.run_id = resolve_run_id(self.config, self.store)
            except Exception as err:  # noqa: BLE001 - classified: anything but an unwritable store is raised
                if not is_store_unwritable(err):
                    raise
                refusal = str(err) if isinstance(err, StoreUnwritable) else (
                    f"store {raw_store.uri} cannot be written: {as_error(err)}; {UNWRITABLE_ADVICE}")
        with self._peers():  # rank 0 gone with a cause of its own (a bad input): its peers end with that cause
            self.attempt, self.run_id, refusal, version = distr.broadcast_object(
                (self.attempt, self.run_id, refusal, version))
        if refusal is not None:
            raise StoreUnwritable(refusal)
        self.data = setup.load_data(self.config, self.task, raw_store, version, env.rank, env.world_size)
        self.phases["data"] = time.time() - _PROCESS_START
        self.total_steps = self.data.total_steps
        self.parts = setup.build_model(self.config, self.task, self.device, self.total_steps, self.spikes, self.data.loader)
        self.phases["build"] = time.time() - _PROCESS_START
        self.tracker = TrainingTracker(self.config, HintWrites(self.store), enabled=env.is_main, run_id=self.run_id,
                                       attempt=self.attempt)
        manager = setup.open_checkpoints(self.config, self.store, self.run_id, self.parts.module)
        if self.inplace is not None:
            self.inplace.attach(manager, self.parts.state)
            self.injection.settle = self.inplace.settle
        self.checkpoints = TrainerCheckpoints(
            self.config, env, manager, self.parts.state, self.tracker, self.log, self.attempt,
            lambda: self.task.evaluate(self.parts.module, setup.validation_split(self.config, self.task, raw_store, self.data)), self._peers,
            self.data.steps_per_epoch, self.total_steps)

    def resume(self) -> None:
        # memory when every rank can serve it, else the store; DDP's buckets warmed as an uninterrupted run's
        result = start(self.config, self.checkpoints.manager, self.parts, self._peers, memory=self.inplace,
                       warm_up=in_place.ddp_warm_up(self))
        restored, restored_at = result.restored, result.taken_at
        self.checkpoints.last_committed = restored.committed
        if restored.step >= 0:
            self.step = self.resumed_from = restored.step
            self.checkpoints.last_saved = result.saved_step  # a step from memory may not be in the store: its save is not skipped
        if self.env.is_main:
            self.phases["resume"] = time.time() - _PROCESS_START
            self.log.record.phases = self.phases
            self.log.record.resumed_from_step = self.resumed_from
            self.log.record.resumed_from_time = restored_at
            self.tracker.start(resumed_from=self.resumed_from, resumed_uri=restored.uri, world_size=self.env.world_size,
                               params=run_params(self.config, self.env))  # and the resumed event

    # ---- the loop

    def loop(self) -> None:
        self.preempt.install()
        watchdog = Watchdog(self.t.hang_timeout_seconds, on_hang=self._record_hang).start()
        if self.log and self.log.record.loop_start is None:  # once per attempt: a recovery in place goes on in it;
            self.log.record.loop_start = time.time()  # written with the first step's record (no fsync before that step)
        cadence = self.checkpoints.cadence
        cadence.restart_clock()
        batches = self.data.loader.batches(self.step)  # from this step on: a resume's, a recovery's
        loop_started = time.monotonic() - self.train_seconds  # a survivor's loop resumed in place adds to its time
        try:
            while self.step < self.total_steps:
                epoch = self.step // self.data.steps_per_epoch
                self.injection.before_step(self.step)
                began = time.perf_counter()
                batch = setup.to_device(next(batches), self.device)
                loss, grad_norm = self._forward_backward(batch)
                snapshot_due, snapshot_busy = self.inplace.snapshot_vote(self.step + 1) if self.inplace else (0.0, 1.0)
                with self._peers():
                    loss_sum, nonfinite, preempted, save_due, snapshot_due, snapshot_busy = distr.all_reduce_sum(
                        [loss if is_finite(loss) else 0.0, 0.0 if is_finite(loss) else 1.0,
                         1.0 if self.preempt.raised else 0.0, 1.0 if cadence.time_due() else 0.0,
                         snapshot_due, snapshot_busy])
                if nonfinite:
                    raise Diverged(f"training diverged: non-finite loss at step {self.step} on "
                                   f"{int(nonfinite)} rank(s); the last good checkpoint is step "
                                   f"{self.checkpoints.last_saved}")
                self.checkpoints.wait_for_snapshot()
                if self.inplace is not None:
                    with self.checkpoints.stalling():
                        self.inplace.before_optimizer_step()
                self.overflows += int(self.parts.optimizer_step())
                self.step += 1
                logs.set_step(self.step)
                state = self.parts.state
                state.step, state.epoch = self.step, self.step // self.data.steps_per_epoch
                state.samples_seen, state.sampler_epoch = self.step * self.t.global_batch_size, epoch
                if snapshot_due and not snapshot_busy:  # every rank alike (the sums above)
                    with self.checkpoints.stalling():
                        self.inplace.after_step(self.step)
                self.compute_seconds += time.perf_counter() - began  # the step without the demo sleep
                self.steps_done += 1
                if self.t.step_sleep_seconds:
                    time.sleep(self.t.step_sleep_seconds)
                step_seconds = time.perf_counter() - began
                watchdog.beat(self.step)
                if self.steps_done == 1:
                    self._first_step_done()
                self._after_step(loss_sum / self.env.world_size, grad_norm, step_seconds, epoch)
                progress.step_done(self.step, self.total_steps, rank=self.env.rank, loss=loss_sum / self.env.world_size)
                if cadence.wanted(self.step, bool(save_due)):
                    self.checkpoints.save(self.step)
                if preempted:
                    self._honour_preemption()
        finally:
            watchdog.stop()
            self.data.loader.close()
            self.train_seconds = time.monotonic() - loop_started

    def _first_step_done(self) -> None:
        """What a restarted worker's first step must not wait for starts now: the ``first-step``
        event goes out before anything imports MLflow or psutil (the logger's sender thread starts
        with the tracker's next ``step_done``; the system-metrics sampler here, on its own thread), and
        the garbage collector runs again."""
        if self.env.is_main:
            emit(Kind.FIRST_STEP, attempt=self.attempt, step=self.step,
                 phases={**{k: round(v, 4) for k, v in self.phases.items()},
                         "first_step": round(time.time() - _PROCESS_START, 4),
                         "exec": round(_PROCESS_START - _PROCESS_CREATED, 4)})
        release_startup_gc()
        if self.run_id and self.env.local_rank == 0:
            self.system_metrics = SystemSampler(tracking_uri(self.config), self.run_id, self.env.node_rank,
                                                lambda: self.step).start()

    def _stop_system_metrics(self, timeout: float, *, hurry: bool = False) -> None:
        if self.system_metrics is not None:
            self.system_metrics.stop(SYSTEM_METRICS_SECONDS_TOLD_TO_GO if hurry else timeout, last_sample=not hurry)

    def _record_hang(self, message: str) -> None:
        """Any rank: the hung rank's record is the attempt's cause, written before it exits, so the peers
        that its exit breaks find it (see :meth:`_cause_of`) instead of recording a killed peer."""
        if self.store is not None:
            records.write_exit_record(self.store, self.attempt, ExitCode.RETRY_ME,
                                      f"rank {self.env.rank} {message}", self.env.elastic_run_id)
        if self.env.is_main and self.log:
            self.log.finish(ExitCode.RETRY_ME)

    def _cause_of(self, err: RelaunchError) -> RelaunchError:
        """A :class:`PeerFailure` is the consequence of another rank's ending: when that rank recorded its
        cause before it went (in the launcher's store, :mod:`~relaunch.components.core.runtime.causes`: a
        full store, a bad input, a bug; or in ``runs/exit.json``: a watchdog's hang), that is the attempt's
        ending, not a killed peer."""
        if not isinstance(err, PeerFailure) or self.env is None:
            return err
        recorded = causes.recorded(self.env)
        if recorded is not None:
            return recorded
        if self.store is None:
            return err
        record = records.read_exit_record(self.store) or {}
        # attempt 0: rank 0 went before the broadcast that names the attempt (its record, written after this
        # process started, is this launch's)
        if ((record.get("attempt") == self.attempt or self.attempt == 0)
                and record.get("elastic_run_id") == self.env.elastic_run_id
                and record.get("time", 0) >= _PROCESS_START and record.get("exit_code")):
            return error_for(int(record["exit_code"]), str(record.get("reason", "")))
        return err

    def _forward_backward(self, batch) -> tuple[float, float]:
        p = self.parts
        # Every part waits on the peers: FSDP gathers parameters in forward, DDP and FSDP reduce the
        # gradients in backward, and the norm of sharded gradients is a collective.
        micro = setup.micro_batches(batch, self.t.grad_accum_steps)
        total = 0.0
        with self._peers():
            for i, part in enumerate(micro):
                with setup.gradient_sync(p.model, i == len(micro) - 1):
                    with torch.autocast(self.device.type, dtype=torch.bfloat16 if self.device.type == "cpu" else torch.float16,
                                        enabled=self.t.amp):
                        loss = self.task.loss(p.model, part) / len(micro)
                    (p.scaler.scale(loss) if p.scaler is not None else loss).backward()
                total += float(loss.detach())
            if p.scaler is not None:
                p.scaler.unscale_(p.optimizer)
            return total, total_grad_norm(p.module, self.t.grad_clip_norm)

    def _after_step(self, loss: float, grad_norm: float, seconds: float, epoch: int) -> None:
        spike = self.spikes.update(loss)
        if not self.env.is_main:
            return
        self.tracker.step_done(self.step)
        self.log.step_done(self.step)
        if self.step % self.t.log_every_steps and self.step != self.total_steps:
            return
        # Named so that the loss sorts first in MLflow's "train" charts (the UI orders them by name).
        metrics = {"train/loss": loss, "train/lr": self.parts.optimizer.param_groups[0]["lr"],
                   "train/optimizer_grad_norm": grad_norm, "train/step_seconds": seconds,
                   "train/samples_per_second": self.t.global_batch_size / seconds if seconds > 0 else 0.0}
        self.tracker.log_step(self.step, metrics, {"train/progress_epoch": float(epoch),
                                                   "health/loss_spikes": float(self.spikes.spikes),
                                                   "health/amp_overflows": float(self.overflows)},
                              total_steps=self.total_steps, epoch=epoch, spike=spike)  # and the progress event

    def _peers(self):
        return waiting_on_peers(self.env.world_size)

    def _honour_preemption(self) -> None:
        """Every rank saw the flag in the same all-reduce: save if that fits the grace, then exit 143."""
        saved = self.checkpoints.save_on_preemption(self.step, self.t.preempt_grace_seconds - self.preempt.seconds_since())
        what = f"checkpoint at step {self.checkpoints.last_saved} committed" if saved else "no time to save"
        raise Preempted(f"preempted by {self.preempt.name} at step {self.step}: {what}")

    # ---- endings

    def finish(self) -> TrainSummary:
        self.checkpoints.save(self.step, wait=True, final=True)
        self.preempt.uninstall()
        self.final_metrics = self.checkpoints.evaluate()
        self.checkpoints.close()
        self._stop_system_metrics(CLOSE_SECONDS_FAILED)
        if not self.env.is_main:
            return self._summary(ExitCode.OK, "finished")
        self.log.finish(ExitCode.OK)
        report = goodput.goodput_report(ledger.load_attempts(self.store))
        report["tracking_overhead"] = self.tracker.overhead(self.steps_done, self.compute_seconds)
        self.tracker.finish(self.step, self.final_metrics, report)
        return self._summary(ExitCode.OK, "finished", report)

    def fail(self, err: RelaunchError) -> TrainSummary:
        """Record how the attempt ended, tell MLflow (FAILED when permanent, KILLED when preempted; a
        retryable failure leaves the run RUNNING for the next attempt), re-raise for the exit code. A
        cause of this rank's own is first recorded for its peers, whose collectives break when it goes."""
        told_peers = isinstance(err, PeerFailure) or causes.record(self.env, err)
        err = self._cause_of(err)
        main = self.env is not None and self.env.is_main and self.store is not None
        if main:  # first, before torchrun (told by a faster rank) stops us: the launcher reads this
            self._record_exit(err)
        elif not told_peers and self.store is not None:  # no launcher's store: the peers' _cause_of reads this
            self._record_exit(err)
        elif isinstance(err, StoreUnwritable) and self.env is not None and self.env.local_rank == 0:
            self._record_exit_locally(err)  # this node's next attempt must not start again
        told_to_go = self.preempt.raised and not isinstance(err, Preempted)
        self.preempt.uninstall()  # a C-level wait in the checkpoint's close must stay killable
        status = "KILLED" if isinstance(err, Preempted) else None if err.exit_code in RETRYABLE else "FAILED"
        if self.checkpoints is not None:
            self.checkpoints.close(after_failure=True)
        self._stop_system_metrics(CLOSE_SECONDS_PREEMPTED, hurry=status is None or told_to_go)
        if main:
            if self.log:
                self.log.finish(err.exit_code)
            # told to go (a peer died, torchrun is stopping us): do not linger; unsent points of
            # committed steps are in the pending-metrics file for the next attempt. While the status
            # goes out a SIGTERM (a faster rank exited and torchrun stops the group) is only noted, so
            # that MLflow learns how the attempt ended; torchrun's SIGKILL bounds the wait.
            self.preempt.install()
            try:
                self.tracker.fail(err, status=status, told_to_go=told_to_go)
                self._summary(err.exit_code, str(err))
            finally:
                self.preempt.uninstall()
        raise err

    def _record_exit(self, err: RelaunchError) -> None:
        """Rank 0 (and a rank with a cause of its own that no launcher's store took: its peers read it
        there): ``runs/exit.json``; where the store cannot take it, this node's file (and the exit event
        and the line on stderr say how the attempt ended to the launcher)."""
        try:
            records.write_exit_record(self.store, self.attempt, err.exit_code, str(err), self.env.elastic_run_id)
        except Exception as write_err:  # noqa: BLE001 - classified: only an unwritable store is expected
            if not is_store_unwritable(write_err):
                raise
            self._record_exit_locally(err)

    def _record_exit_locally(self, err: RelaunchError) -> None:
        if not self.env.elastic_run_id:
            return
        with contextlib.suppress(OSError):
            local_exit_record(self.env.elastic_run_id).write_text(json.dumps(
                {"exit_code": int(err.exit_code), "kind": type(err).kind, "reason": str(err), "time": time.time()}))

    def _summary(self, code: int, reason: str, report: dict | None = None) -> TrainSummary:
        summary = ledger.summarize(
            self.store if self.env.is_main else None, code, reason, run_id=self.run_id, attempt=self.attempt,
            last_step=self.step, last_committed=self.checkpoints.last_committed if self.checkpoints else None,
            total_steps=self.total_steps, train_seconds=self.train_seconds, report=report,
            final_metrics=self.final_metrics)
        if self.env.is_main:
            try:
                ledger.record_ending(self.store, summary, self.env.elastic_run_id)
            except Exception as err:  # noqa: BLE001 - classified: a store that cannot be written keeps no records
                if not is_store_unwritable(err):
                    raise
            emit(Kind.SUMMARY, **asdict(summary))
        return summary


def run(config: RelaunchConfig) -> TrainSummary:
    """Train (or resume) to the end on this rank; raises the contract's errors for the exit code."""
    logs.configure(config, role="worker")
    training = Training(config)
    try:
        training.setup()
        training.resume()
        while True:
            try:
                training.loop()
                return training.finish()  # its final save's collectives too: a peer lost there is recovered
            except PeerFailure as err:  # a killed peer: a survivor recovers in place when it can
                if training.inplace is None or not training.inplace.recover(training, err):
                    raise
    except RelaunchError as err:
        return training.fail(err)
    except Exception as err:
        lost = loader_worker_loss(err)  # torch raises it wherever the training is when the worker dies
        if lost is not None:
            return training.fail(lost)
        if isinstance(err, torch.distributed.DistError):  # another rank died, outside waiting_on_peers
            return training.fail(PeerFailure(err))
        # recorded with the contract's code for it (a bug 1, a server's 503 138, ...), then the entry
        # wrapper ends the process with the same code and line as any other entry point
        try:
            training.fail(as_error(err))
        except RelaunchError:
            pass
        raise
    finally:
        release_startup_gc()  # an attempt that ended before its first step
        distr.shutdown()


def main(argv: list[str] | None = None) -> int:
    """``python -m relaunch.components.train --config FILE | --config-json JSON [--set k=v ...]``."""
    wiring.wire()
    parser = argparse.ArgumentParser(prog="python -m relaunch.components.train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="YAML configuration file")
    parser.add_argument("--config-json", help="the whole configuration as JSON (what pipelines pass)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    rank = os.environ.get("RANK", "0")
    try:
        # a cluster study's trial: its suggested values and its own folder, from the job's environment
        run(suggestions.from_environment(config_from_cli(args.config, args.config_json, args.overrides)))
        return int(ExitCode.OK)
    except Exception as err:  # noqa: BLE001 - the one entry wrapper's code and line
        failure = report(f"train[rank {rank}]", err)
        if rank == "0":
            emit(Kind.EXIT, exit_code=failure.exit_code, reason=failure.message)
        return failure.exit_code


if __name__ == "__main__":
    from .core.runtime.stepcli import end_process

    sys.stdout.reconfigure(line_buffering=True)
    code = main()
    # A permanently failed rank ends the usual way (the interpreter's teardown takes seconds): torchrun
    # stops its peers once it has ended, and rank 0 must first mark the run FAILED. A transient
    # failure (a peer was killed: 137, or 138) marks nothing, and the restart waits for every rank of the group.
    if code in (ExitCode.OK, ExitCode.KILLED, ExitCode.RETRY_ME):
        end_process(code)
    sys.exit(code)
