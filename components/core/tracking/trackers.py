"""The tracker seam: what the training tells a tracking system, and the registry of those systems.

A tracker is one module with a class implementing :class:`Tracker` (subclass :class:`TrackerBase`
for no-op defaults) and a factory ``open(config, store, *, run_id, attempt) -> Tracker | None``
that returns None when the configuration does not ask for it. It is registered by one
:func:`register_tracker` line at the end of this file (a ``"module:factory"`` string, imported only
when a training opens its trackers). :class:`relaunch.components.core.trainer.tracking.TrainingTracker`
fans every call out to the trackers :func:`open_trackers` returns, on rank 0 only.

    mlflow        components/core/tracking/mlflow_tracker.py       always (the run of the training)
    tensorboard   components/core/tracking/tensorboard_tracker.py  when tracking.tensorboard_dir is set
    wandb         components/core/tracking/wandb_tracker.py        when tracking.wandb is set
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Union, runtime_checkable


@dataclass(frozen=True)
class AttemptStart:
    """An attempt starting (or resuming) the training's run."""

    attempt: int  # 1-based
    resumed_from: int  # the step of the checkpoint it resumed from, -1 for a fresh start
    resumed_uri: str | None
    world_size: int


@dataclass(frozen=True)
class AttemptEnd:
    """How an attempt ended under our control."""

    step: int
    exit_code: int
    reason: str
    status: str | None  # the run's terminal status (FINISHED, FAILED, KILLED), None: it stays open for a retry
    told_to_go: bool = False  # the worker group is being stopped: be quick
    report: dict[str, Any] = field(default_factory=dict)  # the goodput report, when the training finished


@runtime_checkable
class Tracker(Protocol):
    """What the training tells one tracking system (rank 0 only, one object per attempt)."""

    def start(self, start: AttemptStart) -> None:
        """Open or resume the training's run."""

    def log_params(self, params: dict[str, Any]) -> None:
        """The run's params (hyper-parameters, world, versions)."""

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Metric values at ``step``."""

    def step_done(self, step: int) -> None:
        """After each training step; raise what retrying cannot help (e.g. refused credentials)."""

    def before_checkpoint(self, step: int) -> None:
        """A checkpoint of ``step`` is about to be written: persist what a crash would lose."""

    def checkpoint_committed(self, step: int, uri: str, key: str) -> None:
        """Checkpoint ``step`` was committed at ``uri`` (``key``: its folder in the store)."""

    def end_attempt(self, end: AttemptEnd) -> None:
        """The attempt ended as ``end`` says."""

    def overhead(self, steps: int, compute_seconds: float) -> dict[str, float]:
        """What this tracker cost the training loop ({} when it does not measure it)."""

    def close(self, timeout: float) -> None:
        """Send what is left within ``timeout`` seconds and let go; idempotent."""


class TrackerBase:
    """No-op defaults of every :class:`Tracker` method: a tracker overrides what it uses."""

    def start(self, start: AttemptStart) -> None:
        pass

    def log_params(self, params: dict[str, Any]) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        pass

    def step_done(self, step: int) -> None:
        pass

    def before_checkpoint(self, step: int) -> None:
        pass

    def checkpoint_committed(self, step: int, uri: str, key: str) -> None:
        pass

    def end_attempt(self, end: AttemptEnd) -> None:
        pass

    def overhead(self, steps: int, compute_seconds: float) -> dict[str, float]:
        return {}

    def close(self, timeout: float) -> None:
        pass


Factory = Callable[..., Union[Tracker, None]]

TRACKERS: dict[str, Union[Factory, str]] = {}
"""The registered trackers by name: a factory or its ``"module:attribute"`` path."""


def register_tracker(name: str, factory: Factory | str) -> None:
    """Register tracker ``name``: ``factory(config, store, *, run_id, attempt)`` returns it, or None
    when the configuration does not use it. Trackers are opened in registration order."""
    TRACKERS[name] = factory


def _factory(entry: Factory | str) -> Factory:
    if isinstance(entry, str):
        module, _, attribute = entry.partition(":")
        return getattr(importlib.import_module(module), attribute)
    return entry


def open_trackers(config, store, *, run_id: str | None, attempt: int) -> list[Tracker]:
    """Every registered tracker the configuration uses, for this attempt."""
    out = []
    for entry in TRACKERS.values():
        tracker = _factory(entry)(config, store, run_id=run_id, attempt=attempt)
        if tracker is not None:
            out.append(tracker)
    return out


register_tracker("mlflow", "relaunch.components.core.tracking.mlflow_tracker:open_tracker")
register_tracker("tensorboard", "relaunch.components.core.tracking.tensorboard_tracker:open_tracker")
register_tracker("wandb", "relaunch.components.core.tracking.wandb_tracker:open_tracker")
