"""The tracker seam: what the training tells a tracking system, and the registry of those systems.

A tracker is one module with a class implementing :class:`Tracker` (subclass :class:`TrackerBase`
for no-op defaults; both in :mod:`~relaunch.components.core.tracking.tracker_protocol`) and a factory ``open(config, store, *, run_id, attempt) -> Tracker | None``
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
from typing import Callable, Union

from .tracker_protocol import AttemptEnd, AttemptStart, Tracker, TrackerBase

__all__ = ["AttemptEnd", "AttemptStart", "Factory", "TRACKERS", "Tracker", "TrackerBase", "open_trackers", "register_tracker"]


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
