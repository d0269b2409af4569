"""Everything the training tells the outside world besides its checkpoints. One object,
:class:`TrainingTracker`, fans each call out to the configured trackers
(:mod:`relaunch.components.core.tracking.trackers`: MLflow, TensorBoard, any registered one) and emits the
``resumed`` and ``progress`` events; every method is a no-op off rank 0, so the training loop calls
it unconditionally. What the MLflow run holds is described in
:mod:`relaunch.components.core.tracking.mlflow_tracker`.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from ..contract.errors import Preempted, RelaunchError
from ..contract.events import Kind, emit
from ..runtime import distributed as distr
from ..store import records
from ..tracking.client import ensure_run, tracking_uri
from ..tracking.trackers import AttemptEnd, AttemptStart, Tracker, open_trackers

# How long the logger may flush before the process exits, by how the attempt ends. Told to go (a peer
# died, torchrun is stopping the group): torchrun's SIGKILL follows shortly; unsent points of committed
# steps are in the pending-metrics file anyway. Preempted: inside the grace period, after the save.
# A permanent failure: nothing is waiting, so the run's last words get time to arrive.
CLOSE_SECONDS_TOLD_TO_GO = 1.0
CLOSE_SECONDS_PREEMPTED = 5.0
CLOSE_SECONDS_FAILED = 15.0
CLOSE_SECONDS_FINISHED = 60.0


def resolve_run_id(config, store) -> str:
    """config.tracking.run_id, else the one stored beside the checkpoints, else a new one (stored)."""
    if config.tracking.run_id:
        return config.tracking.run_id
    stored = records.stored_run_id(store)
    if stored:
        return stored

    return records.remember_run(store, ensure_run(config), tracking_uri=tracking_uri(config),
                                experiment=config.tracking.experiment)  # another start may have won the race


def run_params(config, env) -> dict[str, Any]:
    """The params of the run: the training's hyper-parameters, the world, the code and the versions."""
    import subprocess

    import torch

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


class TrainingTracker:
    """Rank 0's trackers for one attempt; inert elsewhere."""

    def __init__(self, config, store, *, enabled: bool, run_id: str | None, attempt: int):
        self.config = config
        self.store = store
        self.enabled = enabled
        self.run_id = run_id
        self.attempt = attempt
        self.trackers: list[Tracker] = (open_trackers(config, store, run_id=run_id, attempt=attempt)
                                        if enabled else [])
        self._counters: tuple | None = None
        self._logged: tuple[int, set[str]] = (-1, set())  # the highest step logged by this process, its keys

    # ---- the attempt's start

    def start(self, *, resumed_from: int, resumed_uri: str | None, params: dict[str, Any], world_size: int) -> None:
        """Open or resume every tracker's run and log the params, then emit the ``resumed`` event."""
        if not self.enabled:
            return
        start = AttemptStart(attempt=self.attempt, resumed_from=resumed_from, resumed_uri=resumed_uri,
                             world_size=world_size)
        for tracker in self.trackers:
            tracker.start(start)
            tracker.log_params(params)
        emit(Kind.RESUMED, step=resumed_from, uri=resumed_uri, attempt=self.attempt, world_size=world_size)

    # ---- during the loop

    def step_done(self, step: int) -> None:
        """After each step: a tracker raises what retrying cannot help (refused credentials)."""
        for tracker in self.trackers:
            tracker.step_done(step)

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
        """Validation metrics; before a checkpoint, each tracker persists what a crash would lose."""
        self._log(step, metrics)
        if before_checkpoint:
            for tracker in self.trackers:
                tracker.before_checkpoint(step)

    def _log(self, step: int, metrics: dict[str, float]) -> None:
        """``metrics`` of ``step`` to every tracker, unless this process logged them already: after a
        recovery in place the survivors compute again the steps after their snapshot, bitwise equal to
        what they logged before the loss (W&B would refuse them with a warning each, TensorBoard show them
        twice)."""
        last, keys = self._logged
        if step < last or (step == last and keys.issuperset(metrics)):
            return
        if step > last:
            self._logged = (step, set(metrics))
        else:
            keys.update(metrics)
        for tracker in self.trackers:
            tracker.log_metrics(metrics, step)

    def checkpoint_committed(self, info) -> None:
        """A committed checkpoint (a :class:`~relaunch.components.core.checkpoint.CheckpointInfo`)."""
        for tracker in self.trackers:
            tracker.checkpoint_committed(info.step, info.uri, info.key)

    # ---- the attempt's end

    def finish(self, step: int, final_metrics: dict[str, float], report: dict[str, Any]) -> None:
        """The training reached its end: final metrics, then each tracker closes the run as finished."""
        if not self.enabled:
            return
        end = AttemptEnd(step=step, exit_code=0, reason="finished", status="FINISHED", report=report)
        for tracker in self.trackers:
            tracker.log_metrics(final_metrics, step)
            tracker.end_attempt(end)
        self.close(CLOSE_SECONDS_FINISHED)

    def fail(self, err: RelaunchError, *, status: str | None, told_to_go: bool) -> None:
        """Tell the trackers how the attempt ended (``status`` None leaves the run open for the next attempt)."""
        if not self.enabled:
            return
        end = AttemptEnd(step=-1, exit_code=int(err.exit_code), reason=str(err), status=status, told_to_go=told_to_go)
        for tracker in self.trackers:
            tracker.end_attempt(end)
        hurry = status is None or told_to_go
        self.close(CLOSE_SECONDS_TOLD_TO_GO if hurry else CLOSE_SECONDS_PREEMPTED if isinstance(err, Preempted)
                   else CLOSE_SECONDS_FAILED)

    def close(self, timeout: float) -> None:
        """Close every tracker (each within ``timeout`` seconds); idempotent."""
        for tracker in self.trackers:
            tracker.close(timeout)

    def overhead(self, steps: int, compute_seconds: float) -> dict[str, float]:
        """The logging cost of this attempt per step, from the tracker that measures it (MLflow's logger)."""
        for tracker in self.trackers:
            cost = tracker.overhead(steps, compute_seconds)
            if cost:
                return cost
        return {}
