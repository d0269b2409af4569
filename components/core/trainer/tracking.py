"""Everything the training tells the outside world besides its checkpoints: the MLflow run (through the
asynchronous :class:`~components.core.tracking.runlogger.RunLogger`), TensorBoard, and the pending-metrics file
that carries unsent metric points across a crash. One object, :class:`TrainingTracker`; every method
is a no-op off rank 0, so the training loop calls it unconditionally.

What the run holds, kept true across restarts:

- ``checkpoint.step-<12 digits>`` (the folder's own name) for each committed checkpoint; when retention
  deletes one, its tag becomes ``deleted by retention: <uri>``; ``checkpoint.latest`` and
  ``checkpoint.latest_step``;
- ``relaunch.attempt.<n>.*`` for every attempt (start, end, exit code, last step, resumed-from step),
  the killed ones included, and ``relaunch.restarts``;
- the goodput report as ``goodput.*`` tags (single numbers, not one-point metric series) plus the
  ``goodput/goodput.png`` figure and ``goodput/goodput.json``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Any

from components.core.store import records
from components.core.tracking import goodput
from components.core.contract.errors import BadInput, Preempted, RelaunchError
from components.core.contract.events import Kind, emit

CHECKPOINT_TAG_PREFIX = "checkpoint."
DELETED_BY_RETENTION = "deleted by retention: "

# How long the logger may flush before the process exits, by how the attempt ends. Told to go (a peer
# died, torchrun is stopping the group): torchrun's SIGKILL follows shortly; unsent points of committed
# steps are in the pending-metrics file anyway. Preempted: inside the grace period, after the save.
# A permanent failure: nothing is waiting, so the run's last words get time to arrive.
CLOSE_SECONDS_TOLD_TO_GO = 1.0
CLOSE_SECONDS_PREEMPTED = 5.0
CLOSE_SECONDS_FAILED = 15.0
CLOSE_SECONDS_FINISHED = 60.0
FLUSH_SECONDS_BEFORE_PLOT = 30.0


def resolve_run_id(config, store) -> str:
    """config.tracking.run_id, else the one stored beside the checkpoints, else a new one (stored)."""
    if config.tracking.run_id:
        return config.tracking.run_id
    stored = records.stored_run_id(store)
    if stored:
        return stored
    from components.core.tracking.client import ensure_run, tracking_uri

    return records.remember_run(store, ensure_run(config), tracking_uri=tracking_uri(config),
                                experiment=config.tracking.experiment)  # another start may have won the race


def run_params(config, env) -> dict[str, Any]:
    """The params of the run: the training's hyper-parameters, the world, the code and the versions."""
    import subprocess

    import torch

    from components.core.runtime import distributed as distr

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
            "backend": distr.backend(), "dataset_version": config.data.version or "built-by-task", "git_commit": commit,
            "image": os.environ.get("RELAUNCH_IMAGE", config.launch.kubernetes.image if config.launch.on_cluster
                                    else "local"),
            "torch_version": torch.__version__, "cuda_version": torch.version.cuda or "none"}


def checkpoint_tag(key: str) -> str:
    """``checkpoint.step-000000000038``: the tag of a checkpoint is its folder's name (one step format)."""
    return CHECKPOINT_TAG_PREFIX + key.rstrip("/").rsplit("/", 1)[-1]


class TrainingTracker:
    """Rank 0's MLflow run + TensorBoard + pending-metrics file for one attempt; inert elsewhere."""

    def __init__(self, config, store, *, enabled: bool, run_id: str | None, attempt: int):
        self.config = config
        self.store = store
        self.enabled = enabled
        self.run_id = run_id
        self.attempt = attempt
        self.logger = None  # RunLogger, from start()
        self.tensorboard = None
        self.recent: list[list] = []  # [step, metrics] not yet confirmed by the tracking server
        self._counters: tuple | None = None
        self._resumed_from = -1
        self._artifacts: tempfile.TemporaryDirectory | None = None  # files the logger uploads; removed at close

    # ---- the attempt's start

    def start(self, *, resumed_from: int, resumed_uri: str | None, params: dict[str, Any], world_size: int) -> None:
        """Open the logger (sending starts after the first step), requeue the points an earlier attempt
        left unsent, reopen the run, log params and the attempt's tags (earlier attempts' included), then
        emit the ``resumed`` event."""
        if not self.enabled:
            return
        from components.core.tracking.runlogger import RunLogger
        from components.core.tracking.client import tracking_uri

        from components.core.checkpoint import step_key

        self._resumed_from = resumed_from
        self.logger = RunLogger(tracking_uri(self.config), self.run_id, defer_start=True)
        self._requeue_pending_metrics()
        if self.attempt > 1:
            self.logger.set_status("RUNNING")
        self.logger.log_params(params)
        attempts = goodput.load_attempts(self.store)
        # an earlier attempt killed before its logger sent anything: its commits are in its record
        earlier = sorted({int(s) for a in attempts if a.attempt != self.attempt for s in a.commits})
        self.logger.set_tags({"relaunch.attempt": self.attempt, "relaunch.resumed_from_step": resumed_from,
                              f"relaunch.attempt.{self.attempt}.resumed_from_step": resumed_from,
                              f"relaunch.attempt.{self.attempt}.world_size": world_size,
                              "relaunch.resumed_from": resumed_uri or "none",
                              **{checkpoint_tag(step_key(s)): self.store.uri_for(step_key(s)) for s in earlier},
                              **goodput.attempt_tags(attempts, current=self.attempt)})
        if earlier:
            self.logger.submit(self._mark_deleted_checkpoints)
        self.tensorboard = self._open_tensorboard()
        emit(Kind.RESUMED, step=resumed_from, uri=resumed_uri, attempt=self.attempt, world_size=world_size)

    def _open_tensorboard(self):
        folder = self.config.tracking.tensorboard_dir
        if not folder:
            return None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise BadInput("tracking.tensorboard_dir is set but the tensorboard package is not installed; "
                           "pip install tensorboard or unset it") from None
        return SummaryWriter(folder)

    def _requeue_pending_metrics(self) -> None:
        """Metric points of steps up to the resumed checkpoint that an earlier attempt may not have
        sent (it was killed with them in its buffer): queue them again; the logger skips those the
        server has. Steps after the checkpoint are recomputed and logged anew."""
        for step, metrics in records.read_pending_metrics(self.store):
            if step <= self._resumed_from:
                self.logger.log_metrics(metrics, step)

    # ---- during the loop

    def step_done(self, step: int) -> None:
        """After each step: raise what retrying cannot help; start sending after this attempt's first step."""
        if not self.enabled:
            return
        if self.logger.fatal:
            raise BadInput(self.logger.fatal)
        if step == self._resumed_from + 2:
            self.logger.start()  # after the first step of this attempt has completed and been timed

    def log_step(self, step: int, metrics: dict[str, float], slow: dict[str, float], *, total_steps: int,
                 epoch: int, spike: bool) -> None:
        """One step's metrics (``slow``: epoch, counters, logged only when they changed), a line on a
        loss spike, and the ``progress`` event."""
        if not self.enabled:
            return
        loss = metrics["train/loss"]
        if spike:
            print(f"relaunch: loss spike at step {step}: {loss:.4g} > {self.config.train.loss_spike_factor} x "
                  "running mean", file=sys.stderr, flush=True)
        key = tuple(slow.values())
        if key != self._counters:
            self._counters = key
            metrics = {**metrics, **slow}
        self._log(step, metrics)
        emit(Kind.PROGRESS, step=step, total_steps=total_steps, loss=round(loss, 6), epoch=epoch, attempt=self.attempt)

    def log_evaluation(self, step: int, metrics: dict[str, float], *, before_checkpoint: bool) -> None:
        """Validation metrics; before a checkpoint, also persist what the server has not confirmed."""
        if not self.enabled:
            return
        self._log(step, metrics)
        if before_checkpoint:
            self.recent = [p for p in self.recent if p[0] > self.logger.confirmed_step]
            records.write_pending_metrics(self.store, step, self.recent)

    def _log(self, step: int, metrics: dict[str, float]) -> None:
        self.logger.log_metrics(metrics, step)
        self.recent.append([step, metrics])
        if self.tensorboard is not None:
            for key, value in metrics.items():
                self.tensorboard.add_scalar(key, value, step)

    def checkpoint_committed(self, info) -> None:
        """Tag a committed checkpoint, and mark the tags of checkpoints retention has deleted since."""
        if not self.enabled:
            return
        self.logger.set_tags({checkpoint_tag(info.key): info.uri, "checkpoint.latest": info.uri,
                              "checkpoint.latest_step": info.step})
        self.logger.submit(self._mark_deleted_checkpoints)

    def _mark_deleted_checkpoints(self, client, run_id: str) -> None:
        """On the logger's thread: every ``checkpoint.step-*`` (and the resumed-from) tag whose folder is
        gone gets the value ``deleted by retention: <uri>``."""
        from mlflow.entities import RunTag

        from components.core.checkpoint import checkpoint_steps, parse_checkpoint_uri

        try:
            existing = set(checkpoint_steps(self.store))
        except Exception as err:  # noqa: BLE001 - the store is away: the next commit reconciles again
            print(f"relaunch: checkpoint tags not reconciled: {err}", file=sys.stderr)
            return
        tags = client.get_run(run_id).data.tags  # an MLflow error here is retried like any send
        stale = {}
        for key, value in tags.items():
            if not (key.startswith(CHECKPOINT_TAG_PREFIX + "step-") or key == "relaunch.resumed_from"):
                continue
            if value.startswith(DELETED_BY_RETENTION) or "/checkpoints/step-" not in value:
                continue
            try:
                root, step = parse_checkpoint_uri(value)
            except BadInput:
                continue
            if step not in existing and root.rstrip("/") == self.store.uri.rstrip("/"):
                stale[key] = DELETED_BY_RETENTION + value
        if stale:
            client.log_batch(run_id, tags=[RunTag(k, v) for k, v in stale.items()])

    # ---- the attempt's end

    def finish(self, step: int, final_metrics: dict[str, float], report: dict[str, Any]) -> None:
        """The training reached its end: final metrics, goodput tags and figure, every attempt's tags,
        the run FINISHED (the pipeline's exit task may still fail it)."""
        if not self.enabled:
            return
        self.logger.log_metrics(final_metrics, step)
        self.logger.set_tags({**goodput.attempt_tags(goodput.load_attempts(self.store)), **self._goodput_tags(report)})
        self.logger.flush(timeout=FLUSH_SECONDS_BEFORE_PLOT)
        self._log_goodput_artifacts(report)
        self.logger.set_status("FINISHED")
        self.close(CLOSE_SECONDS_FINISHED)

    @staticmethod
    def _goodput_tags(report: dict[str, Any]) -> dict[str, str]:
        tags = {f"goodput.{k}": f"{v:.4g}" if isinstance(v, float) else str(v)
                for k, v in report.items() if isinstance(v, (int, float))}
        overhead = report.get("tracking_overhead") or {}
        if "ratio" in overhead:
            tags["tracking.overhead_ratio"] = f"{overhead['ratio']:.4g}"
        return tags

    def _log_goodput_artifacts(self, report: dict[str, Any]) -> None:
        curve: list[tuple[int, float]] = []
        try:
            client = self.logger.get_client()
            curve = [(m.step, m.value) for m in client.get_metric_history(self.run_id, "train/loss")]
        except Exception as err:  # noqa: BLE001 - the server is away: the plot goes without its loss curve
            print(f"relaunch: no loss curve for the goodput plot: {err}", file=sys.stderr)
        # the logger uploads from its thread: the folder lives until close() has flushed it
        self._artifacts = self._artifacts or tempfile.TemporaryDirectory(prefix="relaunch-goodput-")
        folder = self._artifacts.name
        with open(os.path.join(folder, "goodput.json"), "w") as fh:
            json.dump(report, fh, indent=2)
        goodput.plot_goodput(report, curve, os.path.join(folder, "goodput.png"))
        self.logger.log_artifact(os.path.join(folder, "goodput.json"), "goodput")
        self.logger.log_artifact(os.path.join(folder, "goodput.png"), "goodput")

    def fail(self, err: RelaunchError, *, status: str | None, told_to_go: bool) -> None:
        """Tell MLflow how the attempt ended (``status`` None leaves the run RUNNING for the next attempt)."""
        if not self.enabled or self.logger is None:
            return
        try:  # this attempt's record is final by now; the store may be what failed, though
            attempts = goodput.attempt_tags(goodput.load_attempts(self.store))
        except Exception:  # noqa: BLE001 - the next attempt writes these tags again
            attempts = {}
        self.logger.set_tags({**attempts, "relaunch.end_reason": str(err)[:5000],
                              f"relaunch.attempt.{self.attempt}.exit_code": int(err.exit_code)})
        if status:
            self.logger.set_status(status)
        hurry = status is None or told_to_go
        self.close(CLOSE_SECONDS_TOLD_TO_GO if hurry else CLOSE_SECONDS_PREEMPTED if isinstance(err, Preempted)
                   else CLOSE_SECONDS_FAILED)

    def close(self, timeout: float) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None
        if self.logger is not None:
            self.logger.close(timeout=timeout)
        if self._artifacts is not None:
            self._artifacts.cleanup()
            self._artifacts = None

    def overhead(self, steps: int, compute_seconds: float) -> dict[str, float]:
        """MLflow logging cost of this attempt per step (caller's time + the sender thread's CPU, which
        competes for the GIL) over the mean step time: the benchmark's "logging overhead" in situ."""
        if not self.enabled:
            return {}
        steps = max(1, steps)
        stats = self.logger.stats
        per_step = (stats.main_thread_seconds + stats.sender_cpu_seconds) / steps
        step = compute_seconds / steps
        return {"seconds_per_step": per_step, "step_seconds": step, "ratio": per_step / step if step else 0.0,
                "main_thread_seconds_per_step": stats.main_thread_seconds / steps,
                "sender_cpu_seconds_per_step": stats.sender_cpu_seconds / steps, "steps": steps}
