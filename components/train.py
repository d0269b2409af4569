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
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
from dataclasses import asdict, dataclass, field  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from components.core import distributed as distr  # noqa: E402
from components.core import goodput  # noqa: E402
from components.core.config import RelaunchConfig, config_from_cli, parse_failure_spec  # noqa: E402
from components.core.errors import BadInput, Diverged, Preempted, RelaunchError, TransientFailure  # noqa: E402
from components.core.exitcodes import PERMANENT, RETRYABLE, ExitCode  # noqa: E402
from components.core.health import SpikeDetector, Watchdog, is_finite  # noqa: E402
from components.core.lineage import start_system_metrics  # noqa: E402
from components.tasks.base import load_task  # noqa: E402

_IMPORTED = time.time()


PENDING_METRICS_KEY = "runs/metrics-pending.json"


@dataclass
class TrainSummary:
    """What an attempt reports (``runs/summary.json``, ``RELAUNCH_SUMMARY``, the step's outputs)."""

    exit_code: int
    reason: str
    run_id: str | None
    attempt: int
    attempts: int = 0
    resumed_from_steps: list[int] = field(default_factory=list)
    last_step: int = -1
    last_committed_step: int = -1
    last_checkpoint_uri: str | None = None
    total_steps: int = 0
    train_seconds: float = 0.0
    ettr: float | None = None
    goodput: dict = field(default_factory=dict)
    final_metrics: dict = field(default_factory=dict)


def emit(kind: str, payload: dict) -> None:
    """One machine-readable line on stdout (rank 0 only) that the launchers parse."""
    print(f"RELAUNCH_{kind} {json.dumps(payload, sort_keys=True, default=str)}", flush=True)


# ------------------------------------------------------------------------------------ signals


class PreemptionFlag:
    """SIGTERM/SIGUSR1 handler: records the signal and its time, nothing else (no I/O in a handler)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.at: float | None = None

    def install(self) -> "PreemptionFlag":
        """From the training loop's start: outside it, a process may sit in a C-level collective or
        rendezvous where a Python handler never runs, so there the default (terminate) is kept."""
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handle)
        return self

    @staticmethod
    def uninstall() -> None:
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, signal.SIG_DFL)

    def _handle(self, signum, _frame) -> None:
        if self.signum is None:
            self.signum, self.at = signum, time.monotonic()

    @property
    def raised(self) -> bool:
        return self.signum is not None


# ------------------------------------------------------------------------------------ failure injection


class Injection:
    """``launch.inject_failure``: fires once per training, claimed by a marker in the store."""

    def __init__(self, spec: str | None, store, rank: int, world: int, pids: list[int]):
        self.kind, self.step = parse_failure_spec(spec)
        self.store, self.rank, self.world, self.pids = store, rank, world, pids
        self.outage_until = 0.0

    def _claim(self) -> bool:
        return self.store.write_if_absent(f"runs/injected/{self.kind}-step-{self.step}", b"fired")

    def before_step(self, step: int) -> None:
        if step != self.step:
            return
        if self.kind == "kill-worker" and self.rank == self.world - 1 and self._claim():
            print(f"relaunch: inject {self.kind}@step={step}: SIGKILL to rank {self.rank}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.kind == "preempt" and self.rank == 0 and self._claim():
            print(f"relaunch: inject preempt@step={step}: SIGTERM to the worker group", file=sys.stderr, flush=True)
            for pid in self.pids:
                os.kill(pid, signal.SIGTERM)
        elif self.kind == "storage-outage" and self.rank == 0 and self._claim():
            self.outage_until = time.monotonic() + 3.0
            print("relaunch: inject storage-outage: the store fails for 3 s", file=sys.stderr, flush=True)


class OutageStore:
    """Wraps the store; while an injected outage lasts every call fails and is retried with backoff."""

    def __init__(self, store, injection: Injection):
        self._store, self._injection = store, injection
        self.failed_calls = 0

    def __getattr__(self, name):
        target = getattr(self._store, name)
        if not callable(target):
            return target

        def call(*args, **kwargs):
            delay = 0.05
            while time.monotonic() < self._injection.outage_until:
                self.failed_calls += 1  # what a real transient error + backoff does, without the error
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
            return target(*args, **kwargs)

        return call


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


def _peer_failure(err: BaseException) -> bool:
    """Whether ``err`` is a collective that broke because another rank went away."""
    dist_error = getattr(torch.distributed, "DistError", ())
    text = str(err)
    return isinstance(err, dist_error) or any(s in text for s in (
        "Connection closed by peer", "Connection reset by peer", "gloo", "NCCL", "Broken pipe", "timed out"))


# ------------------------------------------------------------------------------------ the training


class Training:
    """One attempt of the training, on one rank. ``run()`` is the whole story; the rest are its steps."""

    def __init__(self, config: RelaunchConfig):
        self.config = config
        self.t = config.train
        self.env: distr.DistEnv | None = None
        self._pending: dict[int, tuple[float, float]] = {}
        self.last_committed = None  # CheckpointInfo of the newest committed checkpoint known here
        self.recent: list = []  # rank 0: [step, metrics] not yet confirmed by the tracking server
        self.preempt = PreemptionFlag()
        self.logger = None
        self.log = None  # rank 0's AttemptLog
        self.attempt = 0
        self.run_id: str | None = None
        self.store = None
        self.manager = None
        self.step = 0
        self.resumed_from = -1
        self.last_saved = -1
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
            if _peer_failure(err):  # another rank died (SIGKILL, OOM): retryable, not our bug
                return self.fail(TransientFailure(f"a peer rank failed: {str(err).splitlines()[0][:200]}"))
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
        self.store = OutageStore(raw_store, self.injection) if self.injection.kind == "storage-outage" else raw_store
        _seed(self.config)
        self.task = task
        self.splits = _splits(self.config, task, self.store)
        self.dataset = self.config.data.version or "built-by-task"
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
        self.spikes = SpikeDetector(self.t.loss_spike_factor)
        self.state = TrainingState(self.module, self.optimizer, self.scheduler, self.scaler,
                                   extra={"health": self.spikes})
        self.phases["build"] = time.time() - _PROCESS_START
        if env.is_main:
            record = goodput.claim_attempt(self.store, _PROCESS_START, env.world_size)
            self.log = goodput.AttemptLog(self.store, record)
            self.attempt = record.attempt
            self.run_id = _resolve_run_id(self.config, self.store)
        self.attempt, self.run_id = distr.broadcast_object((self.attempt, self.run_id))
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

        start = start_point(self.config, self.manager)  # collective: rank 0 decides, every rank gets it
        uri = start.uri
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
            self._start_tracking(uri)
            emit("RESUMED", {"step": self.resumed_from, "uri": uri, "attempt": self.attempt,
                             "world_size": self.env.world_size})

    def _start_tracking(self, uri: str | None) -> None:
        from components.core.tracking import RunLogger, tracking_uri

        self.logger = RunLogger(tracking_uri(self.config), self.run_id, defer_start=True)
        self._requeue_pending_metrics()
        if self.attempt > 1:
            self.logger.set_status("RUNNING")
        self.logger.log_params(_params(self.config, self.env, self.dataset))
        self.logger.set_tags({"relaunch.attempt": self.attempt, "relaunch.resumed_from_step": self.resumed_from,
                              f"relaunch.attempt.{self.attempt}.resumed_from_step": self.resumed_from,
                              f"relaunch.attempt.{self.attempt}.world_size": self.env.world_size,
                              "relaunch.resumed_from_uri": uri or "none"})
        if self.config.tracking.tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise BadInput("tracking.tensorboard_dir is set but the tensorboard package is not installed; "
                               "pip install tensorboard or unset it") from None
            self.tb = SummaryWriter(self.config.tracking.tensorboard_dir)
        else:
            self.tb = None

    def _requeue_pending_metrics(self) -> None:
        """Metric points of steps up to the resumed checkpoint that an earlier attempt may not have
        sent (it was killed with them in its buffer): queue them again; the logger skips those the
        server has. Steps after the checkpoint are recomputed and logged anew."""
        try:
            pending = json.loads(self.store.read_bytes(PENDING_METRICS_KEY))
        except FileNotFoundError:
            return
        for step, metrics in pending.get("points", []):
            if step <= self.resumed_from:
                self.logger.log_metrics(metrics, step)

    def _save_pending_metrics(self) -> None:
        """Before a checkpoint: persist the points the server has not confirmed yet (rank 0)."""
        self.recent = [p for p in self.recent if p[0] > self.logger.confirmed_step]
        self.store.write_bytes(PENDING_METRICS_KEY, json.dumps({"through_step": self.step, "points": self.recent}).encode())

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
        amp = self.t.amp
        with torch.autocast(self.device.type, dtype=torch.bfloat16 if self.device.type == "cpu" else torch.float16,
                            enabled=amp):
            loss = self.task.loss(self.model, batch)
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            self.scaler.unscale_(self.optimizer)
        else:
            loss.backward()
        from components.core.parallel import total_grad_norm

        return float(loss.detach()), total_grad_norm(self.module)

    def _optimizer_step(self) -> None:
        if self.scaler is not None:
            scale = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.overflows = getattr(self, "overflows", 0) + int(self.scaler.get_scale() < scale)
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()

    def _after_step(self, loss: float, grad_norm: float, seconds: float, epoch: int) -> None:
        spike = self.spikes.update(loss)
        if not self.env.is_main:
            return
        if self.logger.fatal:
            raise BadInput(self.logger.fatal)
        if self.step == self.resumed_from + 2:
            self.logger.start()  # after the first step of this attempt has completed and been timed
        self.log.step_done(self.step)
        if self.step % self.t.log_every_steps and self.step != self.total_steps:
            return
        lr = self.optimizer.param_groups[0]["lr"]
        metrics = {"train/loss": loss, "train/lr": lr, "train/grad_norm": grad_norm, "train/step_seconds": seconds,
                   "train/samples_per_second": self.t.global_batch_size / seconds if seconds > 0 else 0.0}
        counters = (float(epoch), float(self.spikes.spikes), float(getattr(self, "overflows", 0)))
        if counters != getattr(self, "_counters", None):  # slow-moving values: only when they change
            self._counters = counters
            metrics.update({"train/epoch": counters[0], "health/loss_spikes": counters[1],
                            "health/amp_overflows": counters[2]})
        if spike:
            print(f"relaunch: loss spike at step {self.step}: {loss:.4g} > {self.t.loss_spike_factor} x running mean",
                  file=sys.stderr, flush=True)
        self.logger.log_metrics(metrics, self.step)
        self.recent.append([self.step, metrics])
        if self.tb is not None:
            for key, value in metrics.items():
                self.tb.add_scalar(key, value, self.step)
        emit("PROGRESS", {"step": self.step, "total_steps": self.total_steps, "loss": round(loss, 6),
                          "epoch": epoch, "attempt": self.attempt})

    def _save_wanted(self, time_due: bool) -> bool:
        every = self.t.checkpoint_every_steps
        epoch_end = self.t.checkpoint_at_epoch_end and self.step % self.steps_per_epoch == 0
        return bool(time_due or epoch_end or (every and self.step % every == 0)) and self.step < self.total_steps

    # ---- checkpoints

    def evaluate(self) -> dict[str, float]:
        began = time.perf_counter()
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
                self._note_commit(self.manager.wait())
            return
        metrics = self.evaluate()
        if self.env.is_main:
            emit("SAVING", {"step": self.step, "attempt": self.attempt})
            self.logger.log_metrics(metrics, self.step)
            self.recent.append([self.step, metrics])
            self._save_pending_metrics()
        began = time.perf_counter()
        step_done_at = time.time()
        self._note_commit(self.manager.wait())  # the previous async save commits here (save() waits too)
        self.manager.save(self.step, self.state, metrics=metrics, epoch=self.state.epoch)
        if self.env.is_main:
            self._pending[self.step] = (step_done_at, self.overhead)
        if wait:
            self._note_commit(self.manager.wait())
        stall = time.perf_counter() - began
        self.overhead += stall
        self.last_saved = self.step
        if self.env.is_main:
            self.log.record.stall_seconds += stall

    def _note_commit(self, latest) -> None:
        """Record and tag a committed checkpoint (an async save commits while the next steps run)."""
        if latest is None:
            return
        self.last_committed = latest
        if not self.env.is_main:
            return
        done_at, overhead = self._pending.pop(latest.step, (time.time(), self.overhead))
        self.log.committed(latest.step, done_at, overhead)
        self.logger.set_tags({f"checkpoint.step-{latest.step:09d}": latest.uri, "checkpoint.latest": latest.uri,
                              "checkpoint.latest_step": latest.step})

    def _honour_preemption(self) -> None:
        """Every rank saw the flag in the same all-reduce: rank 0 decides whether a save fits the grace."""
        fits = True
        if self.env.is_main:
            elapsed = time.monotonic() - self.preempt.at if self.preempt.at else 0.0
            expected = float(getattr(self.manager, "last_save_seconds", 0.0) or 0.0)
            fits = expected * 1.5 + 1.0 < self.t.preempt_grace_seconds - elapsed
        fits = distr.broadcast_object(fits)
        if fits:
            self.save(wait=True)
        else:
            self._note_commit(self.manager.wait())
        saved = f"checkpoint at step {self.last_saved} committed" if fits else "no time to save"
        sig = signal.Signals(self.preempt.signum).name if self.preempt.signum else "a signal"
        raise Preempted(f"preempted by {sig} at step {self.step}: {saved}")

    # ---- endings

    def finish(self) -> TrainSummary:
        self.save(wait=True)
        self.preempt.uninstall()
        self.final_metrics = self.evaluate()
        self.manager.close()
        if not self.env.is_main:
            return self._summary(ExitCode.OK, "finished")
        self.logger.log_metrics(self.final_metrics, self.step)
        self.log.finish(ExitCode.OK)
        report = goodput.goodput_report(goodput.load_attempts(self.store))
        report["tracking_overhead"] = self._tracking_overhead()
        self._log_goodput(report)
        self.logger.set_status("FINISHED")
        self.logger.close(timeout=60)
        return self._summary(ExitCode.OK, "finished", report)

    def _tracking_overhead(self) -> dict:
        """MLflow logging cost of this attempt per step (caller's time + the sender thread's CPU, which
        competes for the GIL) over the mean step time: the benchmark's "logging overhead" in situ."""
        steps = max(1, self.steps_done)
        stats = self.logger.stats
        per_step = (stats.main_thread_seconds + stats.sender_cpu_seconds) / steps
        step = self.compute_seconds / steps
        return {"seconds_per_step": per_step, "step_seconds": step, "ratio": per_step / step if step else 0.0,
                "main_thread_seconds_per_step": stats.main_thread_seconds / steps,
                "sender_cpu_seconds_per_step": stats.sender_cpu_seconds / steps, "steps": self.steps_done}

    def _log_goodput(self, report: dict) -> None:
        import tempfile

        metrics = {f"goodput/{k}": float(v) for k, v in report.items() if isinstance(v, (int, float))}
        metrics["tracking/overhead_ratio"] = report["tracking_overhead"]["ratio"]
        self.logger.log_metrics(metrics, self.step)
        self.logger.flush(timeout=30)
        curve: list[tuple[int, float]] = []
        try:
            client = self.logger._get_client()
            curve = [(m.step, m.value) for m in client.get_metric_history(self.run_id, "train/loss")]
        except Exception as err:  # the server is away: the plot goes without its loss curve
            print(f"relaunch: no loss curve for the goodput plot: {err}", file=sys.stderr)
        folder = tempfile.mkdtemp(prefix="relaunch-goodput-")
        with open(os.path.join(folder, "goodput.json"), "w") as fh:
            json.dump(report, fh, indent=2)
        goodput.plot_goodput(report, curve, os.path.join(folder, "goodput.png"))
        self.logger.log_artifact(os.path.join(folder, "goodput.json"), "goodput")
        self.logger.log_artifact(os.path.join(folder, "goodput.png"), "goodput")

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
            if self.logger is not None:
                self.logger.set_tags({"relaunch.end_reason": str(err)[:5000]})
                if status:
                    self.logger.set_status(status)
                # told to go (a peer died, torchrun is stopping us): do not linger; unsent points of
                # committed steps are in runs/metrics-pending.json for the next attempt
                hurry = status is None or (self.preempt.raised and not isinstance(err, Preempted))
                self.logger.close(timeout=1 if hurry else 5 if isinstance(err, Preempted) else 15)
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
            goodput.write_exit_record(self.store, self.attempt, code, reason, self.env.elastic_run_id)
            self.store.write_bytes(goodput.SUMMARY_KEY, json.dumps(asdict(summary), indent=2, default=str).encode())
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
