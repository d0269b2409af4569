"""The training entrypoint every torchrun worker (and every PyTorchJob pod) runs.

    .venv/bin/torchrun --nnodes=1 --nproc-per-node=2 --max-restarts=3 --monitor-interval=0.5 \\
        --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:29400 --rdzv-id=demo \\
        --rdzv-conf=join_timeout=30,last_call_timeout=1,close_timeout=5 --shutdown-timeout=25 \\
        -m components.train --config relaunch.yaml --set train.epochs=2

    python -m components.train --config-json '{"train": {"max_steps": 20}}'    # a world of one

It resumes by itself: rank 0 finds the latest committed checkpoint of the store (else
``train.resume_from``) and every rank loads it. The data cursor is the global sample index
``step * global_batch_size`` into a seeded per-epoch permutation, each rank taking its slice of the
global batch, so the order after a resume equals an uninterrupted run's at any world size.

SIGTERM and SIGUSR1 only set a flag; the ranks agree on it at the next step boundary (the step's one
all-reduce), save when the last save's duration fits the grace period left, and exit 143. A NaN/inf
loss exits 3 without saving; a hung rank exits 138 (watchdog). Rank 0 alone talks to MLflow, through
a buffered asynchronous logger. Every attempt ending under our control writes ``runs/exit.json`` and
``runs/summary.json`` in the store and prints ``RELAUNCH_SUMMARY {json}`` (see
:mod:`components.core.goodput`); progress lines are ``RELAUNCH_RESUMED {json}`` and
``RELAUNCH_PROGRESS {json}``.
"""

from __future__ import annotations

import time

_PROCESS_START = time.time()  # before the heavy imports: start-up time is part of goodput

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from dataclasses import asdict  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from components.core import distributed as distr  # noqa: E402
from components.core import goodput  # noqa: E402
from components.core.config import RelaunchConfig, config_from_cli  # noqa: E402
from components.core.errors import BadInput, Diverged, Preempted, RelaunchError, TransientFailure  # noqa: E402
from components.core.exitcodes import PERMANENT, RETRYABLE, ExitCode  # noqa: E402
from components.core.goodput import TrainSummary  # noqa: E402
from components.core.health import PreemptionFlag, SpikeDetector, Watchdog, is_finite, save_fits_grace  # noqa: E402
from components.core.injection import Injection, wrap_store  # noqa: E402
from components.core.lineage import start_system_metrics  # noqa: E402
from components.core.train_tracking import TrainingTracker  # noqa: E402
from components.tasks.base import load_task  # noqa: E402

_IMPORTED = time.time()


def emit(kind: str, payload: dict) -> None:
    """One machine-readable line on stdout (rank 0 only) that the launchers parse."""
    print(f"RELAUNCH_{kind} {json.dumps(payload, sort_keys=True, default=str)}", flush=True)


# ------------------------------------------------------------------------------------ set-up helpers


def _seed(config: RelaunchConfig) -> None:
    import random

    seed = config.train.seed
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if config.train.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        if torch.cuda.is_available() or "torch._inductor" in sys.modules:
            torch.use_deterministic_algorithms(True)
        else:
            # the public call imports torch._inductor (~3 s per restarted worker) only to set a flag
            # that matters to torch.compile; eager CPU ops read this one
            torch._C._set_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False


def _splits(config: RelaunchConfig, task, store) -> dict:
    if config.data.version:
        from components.core.datasets import read_dataset

        return read_dataset(store, config.data.version)
    return task.build_splits()


def _resolve_run_id(config: RelaunchConfig, store) -> str:
    """config.tracking.run_id, else the one stored beside the checkpoints, else a new one (stored)."""
    if config.tracking.run_id:
        return config.tracking.run_id
    try:
        return json.loads(store.read_bytes(goodput.RUN_KEY))["run_id"]
    except FileNotFoundError:
        pass
    from components.core.tracking import ensure_run, tracking_uri

    run_id = ensure_run(config)
    if not store.write_if_absent(goodput.RUN_KEY, json.dumps({"run_id": run_id, "tracking_uri": tracking_uri(config),
                                                              "experiment": config.tracking.experiment}).encode()):
        run_id = json.loads(store.read_bytes(goodput.RUN_KEY))["run_id"]  # another start won the race
    return run_id


def _permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n)


def _params(config: RelaunchConfig, env: distr.DistEnv, dataset: str) -> dict:
    import subprocess

    commit = os.environ.get("RELAUNCH_GIT_COMMIT")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                                    cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or "unknown"
        except (OSError, subprocess.SubprocessError):
            commit = "unknown"
    hp = {f"train.{k}": v for k, v in config.train.model_dump().items() if v is not None}
    return {**hp, "world_size": env.world_size, "nodes": env.nodes, "procs_per_node": env.local_world_size,
            "nodes_x_procs": f"{env.nodes}x{env.local_world_size}",
            "accelerator": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
            "backend": distr.backend(), "dataset_version": dataset, "git_commit": commit,
            "image": os.environ.get("RELAUNCH_IMAGE", config.launch.kubernetes.image if config.launch.on_cluster
                                    else "local"),
            "torch_version": torch.__version__, "cuda_version": torch.version.cuda or "none"}


def _refuse_permanent_restart(env: distr.DistEnv, store) -> None:
    """torchrun restarts a worker group whatever its exit code; a permanent failure (bad input, a
    divergence, a bug) of this same torchrun run ends the restart at once with the same code."""
    if env.restart_count == 0 or not env.elastic_run_id:
        return
    record = goodput.read_exit_record(store)
    if record and record.get("elastic_run_id") == env.elastic_run_id and record.get("exit_code") in PERMANENT:
        err = {ExitCode.BAD_INPUT: BadInput, ExitCode.DIVERGED: Diverged}.get(record["exit_code"], RelaunchError)(
            f"not restarting after a permanent failure: {record.get('reason', '')}")
        err.exit_code = int(record["exit_code"])
        raise err


class PeerFailure(TransientFailure):
    """A collective broke because another rank went away (SIGKILL, OOM, a lost node): retryable."""


@contextlib.contextmanager
def waiting_on_peers(world_size: int):
    """Around the calls that wait on the other ranks (DDP's backward all-reduce, our all-reduces and
    broadcasts, the checkpoint manager's agreements). Classified by type and place, never by message
    text: torch's distributed errors (``DistError``, what NCCL and the c10d store raise) anywhere, and
    a ``RuntimeError`` raised here while there are peers (what gloo raises when a peer's socket
    closes), are a :class:`PeerFailure`; our own errors pass unchanged."""
    try:
        yield
    except RelaunchError:
        raise
    except (torch.distributed.DistError, RuntimeError) as err:
        if isinstance(err, torch.distributed.DistError) or world_size > 1:
            raise PeerFailure(f"a peer rank failed: {str(err).splitlines()[0][:200]}") from err
        raise


# ------------------------------------------------------------------------------------ the training


class Training:
    """One attempt of the training, on one rank: build, resume, loop, end. Tracking is
    :class:`TrainingTracker`'s, faults :mod:`components.core.injection`'s, the attempt records
    :mod:`components.core.goodput`'s."""

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
        self.splits: dict = {}
        self.dataset = config.data.version or "built-by-task"
        self.x: torch.Tensor | None = None
        self.y: torch.Tensor | None = None
        self.steps_per_epoch = 0
        self.total_steps = 0
        self.module = self.model = self.optimizer = self.scheduler = self.scaler = None
        self.spikes = SpikeDetector(self.t.loss_spike_factor)
        self.state = None
        self.manager = None
        self.log: goodput.AttemptLog | None = None  # rank 0's attempt record
        self.tracker = TrainingTracker(config, None, enabled=False, run_id=None, attempt=0)
        self.preempt = PreemptionFlag()
        self.system_metrics = None  # on each node's local rank 0: MLflow's system-metrics monitor
        # progress of this attempt
        self.attempt = 0
        self.run_id: str | None = None
        self.step = 0
        self.resumed_from = -1
        self.last_saved = -1
        self.last_committed = None  # CheckpointInfo of the newest committed checkpoint known here
        self._pending: dict[int, tuple[float, float]] = {}  # rank 0: step -> (done at, overhead then)
        self.overflows = 0
        self.final_metrics: dict = {}
        self.train_seconds = 0.0
        self.overhead = 0.0  # checkpoint stall + evaluation, this attempt
        self.compute_seconds = 0.0  # this attempt's steps, without step_sleep_seconds
        self.steps_done = 0

    # ---- the story

    def run(self) -> TrainSummary:
        try:
            self.setup()
            self.resume()
            self.loop()
            return self.finish()
        except RelaunchError as err:
            return self.fail(err)
        except Exception as err:
            if isinstance(err, torch.distributed.DistError):  # another rank died, outside waiting_on_peers
                return self.fail(PeerFailure(f"a peer rank failed: {str(err).splitlines()[0][:200]}"))
            # a bug: record it as exit 1 (permanent), then let the traceback show
            bug = RelaunchError(f"unhandled {type(err).__name__}: {err}")
            try:
                self.fail(bug)
            except RelaunchError:
                pass
            raise

    # ---- set-up: build everything, then act

    def setup(self) -> None:
        from components.core.checkpoint import CheckpointManager
        from components.core.parallel import wrap_model
        from components.core.state import TrainingState, model_fingerprint
        from components.core.storage import open_store

        self.env = env = distr.read_env()
        if self.t.global_batch_size % env.world_size:
            raise BadInput(f"train.global_batch_size={self.t.global_batch_size} is not divisible by the world size "
                           f"{env.world_size}; pick a multiple")
        distr.init(env, self.t.process_group_timeout_seconds)
        self.phases = {"imports": _IMPORTED - _PROCESS_START, "process_group": time.time() - _PROCESS_START}
        self.device = distr.device(env)
        task = load_task(self.t.task, self.config)
        raw_store = open_store(self.config.store.uri)
        _refuse_permanent_restart(env, raw_store)
        pids = [os.getpid()]
        if env.world_size > 1:
            gathered: list = [None] * env.world_size
            torch.distributed.all_gather_object(gathered, os.getpid())
            pids = gathered
        self.injection = Injection(self.config.launch.inject_failure, raw_store, env.rank, env.world_size, pids)
        self.store = wrap_store(raw_store, self.injection)
        _seed(self.config)
        self.task = task
        self.splits = _splits(self.config, task, self.store)
        train = self.splits["train"]
        self.x = torch.from_numpy(np.ascontiguousarray(train["x"]))
        self.y = torch.from_numpy(np.ascontiguousarray(train["y"]))
        self.steps_per_epoch = len(self.x) // self.t.global_batch_size
        if self.steps_per_epoch == 0:
            raise BadInput(f"train.global_batch_size={self.t.global_batch_size} exceeds the {len(self.x)} training "
                           "samples; lower it")
        self.total_steps = self.t.max_steps or self.t.epochs * self.steps_per_epoch
        self.module = task.build_model().to(self.device)
        self.model = wrap_model(self.module, parallelism=self.t.parallelism, device=self.device,
                                mixed_precision=self.t.mixed_precision, blocks=getattr(task, "shard_blocks", None))
        self.optimizer = task.build_optimizer(self.module)
        self.scheduler = task.build_scheduler(self.optimizer, self.total_steps)
        self.scaler = torch.amp.GradScaler("cuda") if self.t.amp and self.device.type == "cuda" else None
        self.state = TrainingState(self.module, self.optimizer, self.scheduler, self.scaler,
                                   extra={"health": self.spikes})
        self.phases["build"] = time.time() - _PROCESS_START
        if env.is_main:
            record = goodput.claim_attempt(self.store, _PROCESS_START, env.world_size)
            self.log = goodput.AttemptLog(self.store, record)
            self.attempt = record.attempt
            self.run_id = _resolve_run_id(self.config, self.store)
        self.attempt, self.run_id = distr.broadcast_object((self.attempt, self.run_id))
        self.tracker = TrainingTracker(self.config, self.store, enabled=env.is_main, run_id=self.run_id,
                                       attempt=self.attempt)
        self.system_metrics = start_system_metrics(self.config, self.run_id, env)
        # one writer identity per training, stable across torchrun restarts and pipeline retries
        owner = os.environ.get("RELAUNCH_OWNER") or os.environ.get("RELAUNCH_PIPELINE_RUN_ID") or f"run:{self.run_id}"
        self.manager = CheckpointManager(
            self.store, keep_last=self.t.keep_last, keep_best=self.t.keep_best, best_metric=self.t.best_metric,
            mode=self.t.best_mode, async_save=self.t.async_save, owner=owner,
            model_fingerprint=model_fingerprint(self.module))

    def resume(self) -> None:
        from components.core.checkpoint.start import start_point
        from components.core.state import ModelWeights

        with self._peers():
            start = start_point(self.config, self.manager)  # collective: rank 0 decides, every rank gets it
        uri = start.uri
        with self._peers():
            if start.weights_only:
                self.manager.load(ModelWeights(self.module), uri=uri)
            elif start.source == "latest":  # a checkpoint found damaged while read: the previous one, together
                self.last_committed = self.manager.load(self.state)
                uri = self.last_committed.uri if self.last_committed is not None else ""
            elif uri:
                self.manager.load(self.state, uri=uri)
        if uri and not start.weights_only:
            self.step = self.resumed_from = self.last_saved = int(self.state.step)
        if self.env.is_main:
            self.phases["resume"] = time.time() - _PROCESS_START
            self.log.record.phases = self.phases
            self.log.record.resumed_from_step = self.resumed_from
            self.tracker.start(resumed_from=self.resumed_from, resumed_uri=uri, world_size=self.env.world_size,
                               params=_params(self.config, self.env, self.dataset))
            emit("RESUMED", {"step": self.resumed_from, "uri": uri, "attempt": self.attempt,
                             "world_size": self.env.world_size})

    # ---- the loop

    def _batch(self, step: int, perm: np.ndarray) -> dict[str, torch.Tensor]:
        g, w, r = self.t.global_batch_size, self.env.world_size, self.env.rank
        start = (step % self.steps_per_epoch) * g
        local = perm[start + r * (g // w): start + (r + 1) * (g // w)]
        index = torch.from_numpy(local.astype(np.int64))
        return {"x": self.x[index].to(self.device), "y": self.y[index].to(self.device), "index": index,
                "step": torch.tensor(step, dtype=torch.int64)}

    def loop(self) -> None:
        self.preempt.install()
        watchdog = Watchdog(self.t.hang_timeout_seconds, on_hang=self._record_hang).start()
        if self.log:
            self.log.record.loop_start = time.time()
            self.log.write()
        last_time_save = time.monotonic()
        perm_epoch, perm = -1, None
        loop_started = time.monotonic()
        try:
            while self.step < self.total_steps:
                epoch = self.step // self.steps_per_epoch
                if epoch != perm_epoch:
                    perm_epoch, perm = epoch, _permutation(self.t.seed, epoch, len(self.x))
                self.injection.before_step(self.step)
                began = time.perf_counter()
                loss, grad_norm = self._forward_backward(self._batch(self.step, perm))
                time_due = (self.t.checkpoint_every_seconds is not None and self.env.is_main
                            and time.monotonic() - last_time_save >= self.t.checkpoint_every_seconds)
                with self._peers():
                    loss_sum, nonfinite, preempted, save_due = distr.all_reduce_sum(
                        [loss if is_finite(loss) else 0.0, 0.0 if is_finite(loss) else 1.0,
                         1.0 if self.preempt.raised else 0.0, 1.0 if time_due else 0.0])
                if nonfinite:
                    raise Diverged(f"training diverged: non-finite loss at step {self.step} on "
                                   f"{int(nonfinite)} rank(s); the last good checkpoint is step {self.last_saved}")
                self._optimizer_step()
                self.step += 1
                self.state.step, self.state.epoch = self.step, self.step // self.steps_per_epoch
                self.state.samples_seen = self.step * self.t.global_batch_size
                self.state.sampler_epoch = epoch
                self.compute_seconds += time.perf_counter() - began  # the step without the demo sleep
                self.steps_done += 1
                if self.t.step_sleep_seconds:
                    time.sleep(self.t.step_sleep_seconds)
                step_seconds = time.perf_counter() - began
                watchdog.beat(self.step)
                self._after_step(loss_sum / self.env.world_size, grad_norm, step_seconds, epoch)
                if self._save_wanted(bool(save_due)):
                    self.save()
                    last_time_save = time.monotonic()
                if preempted:
                    self._honour_preemption()
        finally:
            watchdog.stop()
            self.train_seconds = time.monotonic() - loop_started

    def _record_hang(self, message: str) -> None:
        if self.env.is_main:
            goodput.write_exit_record(self.store, self.attempt, ExitCode.RETRY_ME, message, self.env.elastic_run_id)
            self.log.finish(ExitCode.RETRY_ME)

    def _forward_backward(self, batch) -> tuple[float, float]:
        from components.core.parallel import total_grad_norm

        amp = self.t.amp
        # Every part waits on the peers: FSDP gathers parameters in forward, DDP and FSDP reduce the
        # gradients in backward, and the norm of sharded gradients is a collective.
        with self._peers():
            with torch.autocast(self.device.type, dtype=torch.bfloat16 if self.device.type == "cpu" else torch.float16,
                                enabled=amp):
                loss = self.task.loss(self.model, batch)
            if self.scaler is not None:
                self.scaler.scale(loss).backward()
                self.scaler.unscale_(self.optimizer)
            else:
                loss.backward()
            return float(loss.detach()), total_grad_norm(self.module)

    def _optimizer_step(self) -> None:
        blocked = self.manager.wait_for_snapshot()  # an async save may still be copying what this step changes
        self.overhead += blocked
        if self.log:
            self.log.record.stall_seconds += blocked
        if self.scaler is not None:
            scale = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.overflows += int(self.scaler.get_scale() < scale)
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()

    def _after_step(self, loss: float, grad_norm: float, seconds: float, epoch: int) -> None:
        spike = self.spikes.update(loss)
        if not self.env.is_main:
            return
        self.tracker.step_done(self.step)
        self.log.step_done(self.step)
        if self.step % self.t.log_every_steps and self.step != self.total_steps:
            return
        lr = self.optimizer.param_groups[0]["lr"]
        metrics = {"train/loss": loss, "train/lr": lr, "train/grad_norm": grad_norm, "train/step_seconds": seconds,
                   "train/samples_per_second": self.t.global_batch_size / seconds if seconds > 0 else 0.0}
        if spike:
            print(f"relaunch: loss spike at step {self.step}: {loss:.4g} > {self.t.loss_spike_factor} x running mean",
                  file=sys.stderr, flush=True)
        self.tracker.log_step(self.step, metrics, slow={"train/epoch": float(epoch),
                                                        "health/loss_spikes": float(self.spikes.spikes),
                                                        "health/amp_overflows": float(self.overflows)})
        emit("PROGRESS", {"step": self.step, "total_steps": self.total_steps, "loss": round(loss, 6),
                          "epoch": epoch, "attempt": self.attempt})

    def _save_wanted(self, time_due: bool) -> bool:
        every = self.t.checkpoint_every_steps
        epoch_end = self.t.checkpoint_at_epoch_end and self.step % self.steps_per_epoch == 0
        return bool(time_due or epoch_end or (every and self.step % every == 0)) and self.step < self.total_steps

    # ---- checkpoints

    def evaluate(self) -> dict[str, float]:
        began = time.perf_counter()
        with self._peers():  # under FSDP the forward gathers parameters from the other ranks
            metrics = {f"val_{k}": v for k, v in self.task.evaluate(self.module, self.splits["val"]).items()}
        spent = time.perf_counter() - began
        self.overhead += spent
        if self.log:
            self.log.record.eval_seconds += spent
        return metrics

    def save(self, *, wait: bool = False) -> None:
        """Checkpoint the current step (a no-op if it is already saved)."""
        if self.step == self.last_saved:
            if wait:
                self._note_commit(self._wait_for_save())
            return
        metrics = self.evaluate()
        if self.env.is_main:
            emit("SAVING", {"step": self.step, "attempt": self.attempt})
        self.tracker.log_evaluation(self.step, metrics, before_checkpoint=True)
        began = time.perf_counter()
        step_done_at = time.time()
        self._note_commit(self._wait_for_save())  # the previous async save commits here (save() waits too)
        with self._peers():
            self.manager.save(self.step, self.state, metrics=metrics, epoch=self.state.epoch, defer_copy=True)
        if self.env.is_main:
            self._pending[self.step] = (step_done_at, self.overhead)
        if wait:
            self._note_commit(self._wait_for_save())
        stall = time.perf_counter() - began
        self.overhead += stall
        self.last_saved = self.step
        if self.log:
            self.log.record.stall_seconds += stall

    def _peers(self):
        return waiting_on_peers(self.env.world_size)

    def _wait_for_save(self):
        with self._peers():
            return self.manager.wait()

    def _note_commit(self, latest) -> None:
        """Record and tag a committed checkpoint (an async save commits while the next steps run)."""
        if latest is None:
            return
        self.last_committed = latest
        if not self.env.is_main:
            return
        done_at, overhead = self._pending.pop(latest.step, (time.time(), self.overhead))
        self.log.committed(latest.step, done_at, overhead)
        self.tracker.checkpoint_committed(latest)

    def _honour_preemption(self) -> None:
        """Every rank saw the flag in the same all-reduce: rank 0 decides whether a save fits the grace."""
        fits = True
        if self.env.is_main:
            last_save = float(getattr(self.manager, "last_save_seconds", 0.0) or 0.0)
            fits = save_fits_grace(last_save, self.t.preempt_grace_seconds - self.preempt.seconds_since())
        with self._peers():
            fits = distr.broadcast_object(fits)
        if fits:
            self.save(wait=True)
        else:
            self._note_commit(self._wait_for_save())
        saved = f"checkpoint at step {self.last_saved} committed" if fits else "no time to save"
        raise Preempted(f"preempted by {self.preempt.name} at step {self.step}: {saved}")

    # ---- endings

    def finish(self) -> TrainSummary:
        self.save(wait=True)
        self.preempt.uninstall()
        self.final_metrics = self.evaluate()
        self.manager.close()
        if not self.env.is_main:
            return self._summary(ExitCode.OK, "finished")
        self.log.finish(ExitCode.OK)
        report = goodput.goodput_report(goodput.load_attempts(self.store))
        report["tracking_overhead"] = self.tracker.overhead(self.steps_done, self.compute_seconds)
        self.tracker.finish(self.step, self.final_metrics, report)
        return self._summary(ExitCode.OK, "finished", report)

    def fail(self, err: RelaunchError) -> TrainSummary:
        """Record how the attempt ended, tell MLflow (FAILED when permanent, KILLED when preempted; a
        retryable failure leaves the run RUNNING for the next attempt), re-raise for the exit code."""
        main = self.env is not None and self.env.is_main and self.store is not None
        if main:  # first, before torchrun (told by a faster rank) stops us: the launcher reads this
            goodput.write_exit_record(self.store, self.attempt, err.exit_code, str(err), self.env.elastic_run_id)
        self.preempt.uninstall()
        status = "KILLED" if isinstance(err, Preempted) else None if err.exit_code in RETRYABLE else "FAILED"
        if self.manager is not None:
            try:
                self.manager.close()  # lets an in-flight save of a good state finish
            except Exception as close_err:  # noqa: BLE001 - cleanup after a failure; the first error wins
                print(f"relaunch: closing the checkpoint manager: {close_err}", file=sys.stderr)
        if main:
            if self.log:
                self.log.finish(err.exit_code)
            # told to go (a peer died, torchrun is stopping us): do not linger; unsent points of
            # committed steps are in the pending-metrics file for the next attempt
            self.tracker.fail(err, status=status, told_to_go=self.preempt.raised and not isinstance(err, Preempted))
            self._summary(err.exit_code, str(err))
        raise err

    def _summary(self, code: int, reason: str, report: dict | None = None) -> TrainSummary:
        attempts = goodput.load_attempts(self.store) if self.env.is_main else []
        latest = self.last_committed
        summary = TrainSummary(
            exit_code=int(code), reason=reason, run_id=self.run_id, attempt=self.attempt, attempts=len(attempts),
            resumed_from_steps=[a.resumed_from_step for a in attempts], last_step=self.step,
            last_committed_step=latest.step if latest is not None else -1,
            last_checkpoint_uri=latest.uri if latest is not None else None, total_steps=self.total_steps,
            train_seconds=round(self.train_seconds, 3), ettr=report.get("ettr") if report else None,
            goodput=report or {}, final_metrics=self.final_metrics)
        if self.env.is_main:
            goodput.record_ending(self.store, summary, self.env.elastic_run_id)
            emit("SUMMARY", asdict(summary))
        return summary


def run(config: RelaunchConfig) -> TrainSummary:
    """Train (or resume) to the end on this rank; raises the contract's errors for the exit code."""
    training = Training(config)
    try:
        return training.run()
    finally:
        distr.shutdown()


def main(argv: list[str] | None = None) -> int:
    """``python -m components.train --config FILE | --config-json JSON [--set k=v ...]``."""
    parser = argparse.ArgumentParser(prog="python -m components.train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="YAML configuration file")
    parser.add_argument("--config-json", help="the whole configuration as JSON (what pipelines pass)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    rank = os.environ.get("RANK", "0")
    try:
        run(config_from_cli(args.config, args.config_json, args.overrides))
        return int(ExitCode.OK)
    except RelaunchError as err:
        print(f"train[rank {rank}]: error: {err}", file=sys.stderr, flush=True)
        if rank == "0":
            emit("EXIT", {"exit_code": int(err.exit_code), "reason": str(err)})
        return int(err.exit_code)


if __name__ == "__main__":
    from components.core.stepcli import end_process

    sys.stdout.reconfigure(line_buffering=True)
    code = main()
    if code == ExitCode.OK:  # a failed rank ends the usual way: torchrun stops its peers once it has ended
        end_process(code)
    sys.exit(code)
