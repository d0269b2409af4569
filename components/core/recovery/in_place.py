"""The worker's side of recovery from memory (``train.memory_tier``, under the in-place agent of
:mod:`relaunch.components.launchers.inplace`).

Each rank keeps its state in the tier: a snapshot every few steps taken beside the training
(:class:`StepSnapshots`; the ranks agree on which steps in the step's own all-reduce) and each save's,
the newer kept. Every start, first or replacement, goes through the recovery room's one start
(:func:`relaunch.components.core.recovery.start.start`), whose memory step is :meth:`InPlace.from_memory`: the ranks
agree on one step that every rank can serve from memory (its own snapshot, or a replacement's replica from its
holder), else every rank reads the store (a fresh training, a whole group restarted, a rank and its
replica's holder lost together). A survivor of a killed peer does not exit: :meth:`InPlace.recover`
drops the broken process group and the checkpoint manager, waits for the agent's next generation,
joins the new rendezvous with the replacement and makes the very collectives the replacement's start
makes (process group, the injection's pid exchange, rank 0's attempt, the model's wrapper, the
checkpoint manager, the restore), then restores its own snapshot into the state it holds.

A hang (138), a NaN (3) or a user error still end the process: only a :class:`PeerFailure`-like
error of the loop is recovered, and the agent replaces only a worker that was killed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import queue
import sys
import threading
import time
from typing import Any, Callable

import torch

from ..checkpoint.layout import MANIFEST, PREFIX, checkpoint_steps, step_key
from ..contract.config import memory_tier_on
from ..contract.events import Kind, emit
from ..runtime import distributed as distr
from ..contract.classify import as_error
from ..contract.errors import RelaunchError, TransientFailure, error_for
from ..runtime import causes
from ..runtime.generations import (GENERATION_ENV, GENERATION_KEY, NODE_ADDRESS_ENV, generation_key,
                                   recovering_key)
from ..trainer import setup
from ..trainer.injection import Injection
from ..trainer.state import rng_now, rng_state
from .memory_tier import MemoryTier, newest_common
from .packing import restore_into
from .start import Restored, Start, start

ABANDON_SECONDS = 30.0
POLL_SECONDS = 0.01  # a survivor looks this often for the agent's next generation (and for why none comes)


def generation() -> int | None:
    """The generation this worker was started into, or None outside the in-place agent."""
    raw = os.environ.get(GENERATION_ENV)
    return int(raw) if raw not in (None, "") else None


def registry(env: distr.DistEnv, timeout_seconds: float) -> Any:
    """A client of the agent's store (the rendezvous store, unprefixed)."""
    import torch.distributed as dist

    return dist.TCPStore(env.master_addr, env.master_port, is_master=False,
                         timeout=datetime.timedelta(seconds=timeout_seconds), wait_for_workers=False)


class CountingStore:
    """The store, counting the bytes of checkpoints read from it (a restore from memory must read none).
    Only keys under the checkpoints' prefix count: the tracker's thread reads the attempt's record
    beside the training, and such a read landing during a restore is not the restore's."""

    def __init__(self, inner: Any):
        self._inner = inner
        self.bytes_read = 0

    def read_bytes(self, key: str) -> bytes:
        data = self._inner.read_bytes(key)
        self._count(key, len(data))
        return data

    def read_into(self, key: str, offset: int, buffer: Any, **kwargs: Any) -> None:
        self._inner.read_into(key, offset, buffer, **kwargs)
        parts = buffer if isinstance(buffer, (list, tuple)) else [buffer]  # one buffer, or consecutive ones
        self._count(key, sum(memoryview(b).nbytes for b in parts))

    def download_file(self, key: str, path: Any) -> None:
        self._inner.download_file(key, path)
        self._count(key, os.path.getsize(path))

    def _count(self, key: str, size: int) -> None:
        if key.startswith(f"{PREFIX}/"):
            self.bytes_read += size

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class StepSnapshots:
    """Every ``every`` steps, the state of the step just done into the memory tier, beside the training.

    At the step's end the training's thread takes what the next step may change before its optimizer
    step (counters, RNG streams, scheduler; with model buffers, which a forward updates, it waits for
    the whole copy) and goes on; a thread copies the model's and optimizer's tensors, which only the
    optimizer step changes (:meth:`before_optimizer_step` waits for that copy, usually long done), and
    hands the snapshot to the rank's holder. A snapshot still being handed over when the next is due
    is skipped: the training never waits on a transfer. ``every`` None: as often as keeps the training
    thread's time on snapshots within ``AUTO_SHARE`` of its time (every step of a step much longer than
    a snapshot's ~0.1 ms; every few of a short one).
    """

    AUTO_SHARE = 0.001

    def __init__(self, tier: MemoryTier, every: int | None):
        self.tier, self.every = tier, every
        self.cost = 0.0  # the training thread's seconds per snapshot, the most recent ones weighing most
        self.last_taken = 0.0  # perf_counter of the last snapshot
        self.state: Any = None
        self.fingerprint: str | None = None
        self.live: dict[str, Any] | None = None  # the state's live model and optimizer tensors
        self.optimizer_entries = -1  # the optimizer's state entries when ``live`` was taken
        self.copied, self.idle = threading.Event(), threading.Event()
        self.copied.set()
        self.idle.set()
        self.pending: queue.SimpleQueue = queue.SimpleQueue()  # (step, head, taken_at), or None to end
        self.failing = False
        self.waits_for_copy = False
        threading.Thread(target=self._run, name="memory-tier-snapshots", daemon=True).start()

    def bind(self, state: Any, fingerprint: str | None) -> None:
        """Take snapshots of ``state`` (a ``TrainingState``; again after a recovery rebuilt it)."""
        import torch.distributed.checkpoint.state_dict  # noqa: F401 - at start-up, not in the first snapshot (60 ms)

        self.halt()
        self.state, self.fingerprint, self.live = state, fingerprint, None
        self.waits_for_copy = any(True for _ in state.model.buffers())

    def vote(self, step: int) -> tuple[float, float]:
        """This rank's say on a snapshot of ``step`` (the step under way): (due, busy). Every rank takes
        it when one finds it due and none is still handing over the previous one: the ranks sum their
        votes in the step's own all-reduce, so that they snapshot the same steps."""
        if self.state is None:
            return 0.0, 1.0
        if self.every is not None:
            due = step % self.every == 0
        else:
            due = time.perf_counter() - self.last_taken >= self.cost / self.AUTO_SHARE
        return float(due), float(not self.idle.is_set())

    def after_step(self, step: int) -> None:
        """Step ``step`` is done and every rank agreed on its snapshot (:meth:`vote`): take it."""
        if self.state is None:
            return
        self.live_tensors()
        began = time.perf_counter()
        head = self.state.step_head(rng_now)
        self.idle.clear()
        self.copied.clear()
        self.pending.put((step, head, time.time()))
        if self.waits_for_copy:
            self.copied.wait()
        self.last_taken = now = time.perf_counter()
        self.cost = now - began if not self.cost else 0.8 * self.cost + 0.2 * (now - began)

    def live_tensors(self) -> dict[str, Any] | None:
        """The bound state's live model and optimizer tensors: found once and kept while the optimizer
        has as many state entries (a first step, a load that replaced them: found again)."""
        if self.state is None:
            return None
        optimizer = self.state.optimizer
        entries = len(optimizer.state) if optimizer is not None else 0
        if self.live is None or entries != self.optimizer_entries:
            self.live, self.optimizer_entries = self.state.live_tensors(), entries
        return self.live

    def before_optimizer_step(self) -> None:
        if not self.copied.is_set():
            self.copied.wait()

    def halt(self, timeout: float | None = None) -> bool:
        """Wait until no snapshot is being taken or handed over; whether none is."""
        return self.idle.wait(timeout)

    def close(self) -> None:
        self.pending.put(None)

    def _run(self) -> None:
        while (job := self.pending.get()) is not None:
            step, head, taken_at = job
            try:
                head["rng"] = {rank: rng_state(now) for rank, now in head["rng"].items()}
                snapshot = {**self.live, **head}
                if "optimizer" in self.live:
                    snapshot["optimizer"] = {"state": self.live["optimizer"]["state"],
                                             "param_groups": self.state.param_groups(self.live)}
                self.tier.keep(step, snapshot, self.fingerprint, taken_at=taken_at, copied=self.copied.set)
                self.failing = False
            except (OSError, ValueError) as err:  # the holder unreachable: the store serves its rank
                if not self.failing:
                    print(f"relaunch: memory tier: the snapshot of step {step} was not handed to its holder: {err}",
                          file=sys.stderr, flush=True)
                self.failing = True
            finally:
                self.copied.set()
                self.idle.set()


class InPlace:
    """One worker's in-place recovery: its memory tier, and the recovery of a survivor."""

    def __init__(self, config, env: distr.DistEnv, store: CountingStore):
        self.config, self.env, self.store = config, env, store
        self.generation = generation() or 0
        self.registry = registry(env, config.train.process_group_timeout_seconds)
        self.tier = MemoryTier(env.rank, env.world_size, self.registry,
                               host=os.environ.get(NODE_ADDRESS_ENV) or "127.0.0.1", per_node=env.local_world_size)
        every = config.train.memory_snapshot_every_steps
        self.snapshots = StepSnapshots(self.tier, every) if every != 0 else None
        self.recoveries: list[Start] = []

    @classmethod
    def for_worker(cls, config, env: distr.DistEnv, store: Any) -> "InPlace | None":
        """The in-place side of this worker when ``train.memory_tier`` is on and the in-place agent
        started it (else None: torchrun's whole-group restart, the store)."""
        if not memory_tier_on(config) or generation() is None or not env.launched:
            return None
        return cls(config, env, store if isinstance(store, CountingStore) else CountingStore(store))

    def attach(self, manager: Any, state: Any) -> None:
        """Feed the tier: each save of ``manager`` (its copy, while the store is written) and, unless
        ``train.memory_snapshot_every_steps`` is 0, snapshots of ``state`` (a ``TrainingState``) taken
        beside the training (:meth:`after_step`); the tier keeps the newer."""
        if self.snapshots is not None:
            self.snapshots.bind(state, manager.model_fingerprint)
        manager.on_snapshot(lambda step, snapshot: self.tier.keep(step, snapshot, manager.model_fingerprint))

    def snapshot_vote(self, step: int) -> tuple[float, float]:
        """(due, busy) for a snapshot of ``step``, summed over the ranks by the step's all-reduce."""
        return self.snapshots.vote(step) if self.snapshots is not None else (0.0, 1.0)

    def after_step(self, step: int) -> None:
        """The training's step ``step`` is done (counters set) and the ranks agreed on its snapshot."""
        if self.snapshots is not None:
            self.snapshots.after_step(step)

    def settle(self, timeout: float = 30.0) -> None:
        """Wait (up to ``timeout``) until the snapshot being taken or handed over, if any, reached the holder."""
        if self.snapshots is not None:
            self.snapshots.halt(timeout)

    def before_optimizer_step(self) -> None:
        """The optimizer step changes what a snapshot may still be copying: wait for it."""
        if self.snapshots is not None:
            self.snapshots.before_optimizer_step()

    @property
    def bytes_read(self) -> int:
        """Bytes this worker has read from the store."""
        return self.store.bytes_read

    @property
    def rank(self) -> int:
        return self.env.rank

    def from_memory(self, manager, parts, peers: Callable[[], Any]) -> tuple[Start | None, str]:
        """The memory step of :func:`~relaunch.components.core.recovery.start.start` (collective): restore
        the newest step that every rank can serve from the tier (its own snapshots, or a replacement's
        replicas on its holder: the one before the newest when a rank was lost handing the newest over)
        when no later step is committed in the store. ``(None, why)`` when the store must serve: then
        what the tier kept is dropped (the training goes back to an older step)."""
        tags, where = self.tier.servable()
        with peers():
            gathered = [None] * self.env.world_size
            if self.env.world_size > 1:
                torch.distributed.all_gather_object(gathered, tags)
            else:
                gathered = [tags]
        step = newest_common(gathered, manager.model_fingerprint)
        held = self.tier.take(step) if step >= 0 else None  # a replacement fetches it from its holder
        missing, saved = float(step >= 0 and held is None), 0.0
        if step >= 0 and self.env.is_main:
            committed = [s for s in checkpoint_steps(self.store) if self.store.exists(f"{step_key(s)}/{MANIFEST}")]
            missing += float(any(s > step for s in committed))  # a commit landed after it: memory lacks it
            saved = float(max([s for s in committed if s <= step], default=-1))
        with peers():
            missing, saved = distr.all_reduce_sum([missing, saved])
        if step < 0 or missing != 0:
            self.tier.drop_own()
            return None, "the tier cannot serve every rank" if any(gathered) else ""
        state = parts.state
        live = self.snapshots.live_tensors() if self.snapshots is not None and self.snapshots.state is state else None
        restore_into(state, *held, live=live)
        self.tier.forget_after(step)
        parts.optimizer.zero_grad(set_to_none=True)
        restored = Restored(f"memory://step-{step}", None, int(state.step))
        return Start(restored, "memory", where, 0, 0.0, held[0].get("taken_at"), int(saved)), where

    # ---- a survivor

    def recover(self, training: Any, cause: BaseException) -> bool:
        """A peer was lost under ``training``'s loop: rejoin the next generation with its replacement
        and restore from memory (collective with the replacement's start). False when no peer was
        lost but one ended for a cause of its own that it recorded (a full store: the caller ends with
        it, :mod:`~relaunch.components.core.runtime.causes`), when the agent stops the group, or when
        it started no next generation in time (the caller ends the process as before).

        Raises:
            RelaunchError: every rank of the group recovers, so none was lost (no agent replaces a
                worker then): the failure of the collective itself, at once.
        """
        began = time.time()
        lost_at = training.step
        if causes.recorded(self.env) is not None:  # the peer went for a cause of its own, not killed
            return False
        with contextlib.suppress(torch.distributed.DistError):  # the agent's store gone: no generation comes either
            self.registry.add(recovering_key(self.generation), 1)
        print(f"relaunch: rank {self.env.rank}: a peer was lost at step {lost_at}; recovering in place "
              f"(this process stays)", file=sys.stderr, flush=True)
        distr.sever()  # a peer still blocked in a collective of the old group fails now, not at its timeout
        distr.shutdown()
        if self.snapshots is not None:  # the snapshot being handed over ends (its holder may be the lost rank)
            self.snapshots.halt(ABANDON_SECONDS)
        self.tier.forget_holder()
        training.checkpoints.manager.abandon(ABANDON_SECONDS)
        gen = self._next_generation(self.config.train.process_group_timeout_seconds, training.preempt, cause)
        if gen is None:
            return False
        self.generation = gen
        os.environ["TORCHELASTIC_RESTART_COUNT"] = str(gen)
        os.environ[GENERATION_ENV] = str(gen)
        self.env = env = dataclasses.replace(training.env, restart_count=gen)
        training.env = env
        distr.init(env, self.config.train.process_group_timeout_seconds)
        training.injection = Injection.for_world(self.config.launch.inject_failure, training.injection.store, env)
        # the collectives of the replacement's setup, in its order: the broadcast of what rank 0 decided
        # (the attempt, its run, the dataset version), then the model's wrapping
        training.attempt, training.run_id, _, _ = distr.broadcast_object(
            (training.attempt, training.run_id, None, training.data.version))
        parts = training.parts
        parts.optimizer.zero_grad(set_to_none=True)  # what the interrupted backward left
        training.parts = parts = _rewrapped(self.config, training, parts)
        manager = setup.open_checkpoints(self.config, training.store, training.run_id, parts.module)
        self.attach(manager, parts.state)
        result = start(self.config, manager, parts, training._peers, memory=self, warm_up=ddp_warm_up(training))
        if result.restored.step < 0:
            # nothing held in memory by every rank and nothing committed: the replacement starts from scratch,
            # but this process's state is past the start; the agent restarts the whole group (138) instead
            raise TransientFailure(f"a peer was lost at step {lost_at}, before any step was held in memory by "
                                   f"every rank or committed to the store: the group starts again from scratch")
        training.checkpoints.rejoin(manager, parts.state, result.restored, training.attempt)
        training.checkpoints.last_saved = result.saved_step
        training.step = training.resumed_from = result.restored.step
        result.seconds = time.time() - began
        self.recoveries.append(result)
        if env.is_main and training.log is not None:  # rank 0 survived: its attempt goes on
            training.log.recovered_in_place(lost_at_step=lost_at, resumed_step=result.restored.step, lost_at=began,
                                            resumed_at=result.taken_at,
                                            seconds=result.seconds, source=result.source)
        if env.is_main:
            emit(Kind.RESUMED, step=result.restored.step, uri=result.restored.uri, attempt=training.attempt,
                 world_size=env.world_size, source=result.source, in_place=True, lost_at_step=lost_at,
                 recovery_seconds=round(result.seconds, 4), store_bytes_read=result.store_bytes_read)
        return True

    def _next_generation(self, timeout: float, told_to_go: Any, cause: BaseException) -> int | None:
        """The generation the agent started after this worker's, once it did (its key set, looked for
        every ``POLL_SECONDS``), or None: a peer recorded a cause of its own meanwhile, the agent told this
        worker to go (``told_to_go.raised``: it stops the group after a worker ended badly), ``timeout``
        passed, or the agent's store is gone. Every rank of the group waiting (:func:`recovering_key`)
        means none was lost: the failure of the collective (``cause``'s) is raised at once."""
        key, recovering = generation_key(self.generation + 1), recovering_key(self.generation)
        deadline = time.monotonic() + timeout
        try:
            while not self.registry.check([key]):
                why = ("a peer ended for a cause of its own" if causes.recorded(self.env) is not None
                       else "the agent stops the group" if told_to_go.raised
                       else f"none after {timeout:.0f} s" if time.monotonic() >= deadline else None)
                if why is not None:
                    print(f"relaunch: in-place recovery: no next generation: {why}", file=sys.stderr, flush=True)
                    return None
                if self.registry.add(recovering, 0) >= self.env.world_size:
                    raise _nobody_lost(cause)
                time.sleep(POLL_SECONDS)
            return int(self.registry.get(GENERATION_KEY))
        except (torch.distributed.DistError, ValueError) as err:
            print(f"relaunch: in-place recovery: no next generation from the agent: {err}", file=sys.stderr, flush=True)
            return None


def _nobody_lost(cause: BaseException) -> RelaunchError:
    """The error of a collective that failed while every rank lived (``cause``: the :class:`PeerFailure`
    of the training's entry, raised from the collective's own error): that error as the contract's
    (its kind and code: a ``DistError`` is retryable, 138), saying that no peer was lost."""
    err = as_error(cause.__cause__ or cause)
    return error_for(int(err.exit_code), f"a collective failed with every rank alive (none was lost and none "
                                         f"recorded a cause): {err}", type(err).kind)


def ddp_warm_up(training: Any) -> Callable[[], None] | None:
    """Under DDP with peers: one forward and backward of a zero loss, before the restore overwrites
    what it touched. DDP orders its gradient buckets by the order the first backward of its process
    made them ready, from its second iteration on; gloo's ring sums an element of a bucket in an order
    that depends on its place there, so with more than two ranks the first step after a restart summed
    differently from an uninterrupted run's (last bits of the weights). After this the first real
    step already runs with the buckets an uninterrupted run has."""
    if training.config.train.parallelism != "ddp" or training.env.world_size <= 2:
        return None

    def warm_up() -> None:
        batch = training.data.loader.first_batch()
        if batch is None:  # a task's own iterable loader: reading one would move it
            return
        batch = setup.to_device(batch, training.device)
        (training.task.loss(training.parts.model, batch) * 0.0).backward()
        training.parts.optimizer.zero_grad(set_to_none=True)

    return warm_up


def _rewrapped(config, training: Any, parts: Any) -> Any:
    """The survivor's model parts over the new process group, as the replacement builds them (the same
    collectives): DDP re-wrapped around the module and optimizer this process holds; FSDP2, whose
    parameters are bound to the old group's mesh, built anew (restored from memory all the same)."""
    from ..trainer.parallel import wrap_model

    t = config.train
    if t.parallelism == "ddp":
        parts.model = None  # the old wrapper's reducer, bound to the dead group, goes first
        parts.model = wrap_model(parts.module, parallelism=t.parallelism, device=training.device,
                                 mixed_precision=t.mixed_precision, blocks=getattr(training.task, "shard_blocks", None))
        return parts
    return setup.build_model(config, training.task, training.device, training.total_steps, training.spikes)
