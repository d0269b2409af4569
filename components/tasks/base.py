"""The Task protocol: what a user implements to train their own model with relaunch.

A task is built by a factory ``package.module:factory`` that takes the :class:`RelaunchConfig` and
returns an object with the methods below (``train.task`` names it; the default is
``relaunch.components.tasks.digits:make_task``). The trainer owns distribution, data order, checkpoints,
signals and tracking; the task owns the model, the optimiser, the data splits and the maths.

Batches reach :meth:`Task.loss` as a dict of tensors: ``x`` and ``y`` (this rank's slice of the
global batch), ``index`` (the global sample indices of those rows in the train split) and ``step``
(the optimiser step being computed, 0-based, a 0-d tensor).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Callable, Protocol, runtime_checkable

import numpy as np

from relaunch.components.core.contract.errors import BadInput

if TYPE_CHECKING:
    import torch
    from torch.optim.lr_scheduler import LRScheduler

    from relaunch.components.core.contract.config import RelaunchConfig

Splits = dict[str, dict[str, np.ndarray]]
"""``{"train"|"val"|"test": {"x": array, "y": array}}``; every split has the same keys."""


@runtime_checkable
class Task(Protocol):
    """What the trainer, evaluate and register steps call. Every method must be deterministic
    given the config's seed, so that a resumed training is bitwise equal to an uninterrupted one."""

    def build_splits(self) -> Splits:
        """The train/val/test arrays (numpy; ``x`` float32, ``y`` int64 for classifiers)."""
        ...

    def build_model(self) -> "torch.nn.Module":
        """A freshly initialised model (the trainer seeds torch before calling)."""
        ...

    def build_optimizer(self, model: "torch.nn.Module") -> "torch.optim.Optimizer":
        """The optimiser over ``model``'s parameters."""
        ...

    def build_scheduler(self, optimizer: "torch.optim.Optimizer", total_steps: int) -> "LRScheduler | None":
        """A learning-rate schedule stepped once per optimiser step, or None."""
        ...

    def loss(self, model: "torch.nn.Module", batch: "dict[str, torch.Tensor]") -> "torch.Tensor":
        """The scalar training loss of ``batch`` (mean over its rows)."""
        ...

    def evaluate(self, model: "torch.nn.Module", split: dict[str, np.ndarray]) -> dict[str, float]:
        """Metrics of ``model`` on a whole split, e.g. ``{"loss": ..., "accuracy": ...}``."""
        ...

    def predict(self, model: "torch.nn.Module", x: np.ndarray) -> np.ndarray:
        """Predicted labels of ``x`` (used for the confusion matrix)."""
        ...

    # Optional: ``shard_blocks(model) -> list[torch.nn.Module]``, the submodules that
    # ``train.parallelism=fsdp`` shards one by one (e.g. a transformer's layers) before the root.
    # Without it every direct child that holds parameters is one block (components/core/trainer/parallel.py).


def load_task(spec: str, config: "RelaunchConfig") -> Task:
    """Import ``package.module:factory`` and call ``factory(config)``.

    Raises:
        BadInput: malformed spec, module or factory not importable, or the result is not a Task.
    """
    if spec.count(":") != 1 or not all(spec.split(":")):
        raise BadInput(f"train.task: {spec!r} is not package.module:factory (e.g. relaunch.components.tasks.digits:make_task)")
    module_name, attr = spec.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise BadInput(f"train.task: cannot import module {module_name!r} ({err}); check the path and PYTHONPATH") from None
    factory: Callable[..., object] | None = getattr(module, attr, None)
    if not callable(factory):
        raise BadInput(f"train.task: module {module_name!r} has no callable {attr!r}")
    try:
        task = factory(config)
    except TypeError as err:  # a factory with another signature: the spec names the wrong thing
        raise BadInput(f"train.task: {spec!r} cannot be called as factory(config): {err}") from None
    missing = [m for m in ("build_splits", "build_model", "build_optimizer", "build_scheduler", "loss",
                           "evaluate", "predict") if not callable(getattr(task, m, None))]
    if missing:
        raise BadInput(f"train.task: {spec!r} returned {type(task).__name__} without {', '.join(missing)}")
    return task  # type: ignore[return-value]
