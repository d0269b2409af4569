"""What a tracker is: the :class:`Tracker` protocol, :class:`TrackerBase` (its no-op defaults) and what an
attempt's start and end tell it. Each tracker module builds on this; the table of trackers and the function
that opens them are :mod:`relaunch.components.core.tracking.trackers`, which names each tracker module (so a
tracker module imports this, never that: no circle)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


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
