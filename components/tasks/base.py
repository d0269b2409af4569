"""The Task protocol: what a user implements to train their own model with relaunch.

A task is built by a factory ``package.module:factory`` that takes the :class:`RelaunchConfig` and
returns an object with the methods below (``train.task`` names it; the default is
``relaunch.components.tasks.digits:make_task``). The trainer owns distribution, data order, checkpoints,
signals and tracking; the task owns the model, the optimiser, its data and the maths.

Where the data comes from (:mod:`relaunch.components.core.data`), the first the task has of:

- ``dataset(split, rank, world_size)``: its own map-style ``Dataset`` (relaunch orders its indices
  globally: any world size resumes it), its own ``IterableDataset`` (sharded by the task for ``rank``;
  read through torchdata's ``StatefulDataLoader``) or its own stateful loader (iterable, with
  ``state_dict``/``load_state_dict``);
- ``build_dataset() -> DatasetSource``: chunks of samples per split, which prepare commits to the
  store as checked shards and every rank streams (a corpus larger than memory);
- ``build_splits() -> {split: {field: array}}``: whole arrays (small data), committed the same way.

Batches reach :meth:`Task.loss` as a dict of tensors: the dataset's fields (this rank's share of the
global batch; for a stored dataset, ``index``: the rows' global sample indices) and ``step`` (the
optimiser step being computed, a 0-d tensor). A task's own dataset's batches are as its collate makes
them (``index`` and ``step`` added to a dict).

``options`` (a class attribute, ``{name: default}``) declares every ``train.task_options`` key the task
reads; any other is refused, in ``relaunch run`` and in a study's search space alike.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Callable, Protocol, runtime_checkable

import numpy as np

from relaunch.components.core.contract.errors import BadInput

if TYPE_CHECKING:
    import torch
    from torch.optim.lr_scheduler import LRScheduler

    from relaunch.components.core.contract.config import RelaunchConfig
    from relaunch.components.core.data.loader import SplitData

Splits = dict[str, dict[str, np.ndarray]]
"""``{"train"|"val"|"test": {"x": array, "y": array}}``; every split has the same keys."""


@runtime_checkable
class Task(Protocol):
    """What the trainer, evaluate and register steps call. Every method must be deterministic
    given the config's seed, so that a resumed training is bitwise equal to an uninterrupted one."""

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

    def evaluate(self, model: "torch.nn.Module", split: "SplitData") -> dict[str, float]:
        """Metrics of ``model`` on a held-out split, e.g. ``{"loss": ..., "accuracy": ...}``:
        ``split.batches(n)`` streams it, ``split["y"]`` is a field of the whole split."""
        ...

    # Optional:
    # - data: ``dataset(split, rank, world_size)``, ``build_dataset()`` or ``build_splits()`` (one is needed);
    # - ``options: dict[str, Any]``: the ``train.task_options`` it reads, with their defaults;
    # - ``predict(model, x) -> labels``: a classifier's; evaluate then logs a confusion matrix;
    # - ``serve(model, inputs)`` and ``example_input()``: what the registered model's ``predict`` does
    #   (default: ``predict`` on a float32 array);
    # - ``package_meta() -> dict`` and ``use_package_meta(meta)``: what a registered model keeps beside its
    #   weights (JSON, e.g. its tokenizer), handed back to the task before ``build_model`` when it is loaded;
    # - ``shard_blocks(model) -> list[torch.nn.Module]``, the submodules that ``train.parallelism=fsdp``
    #   shards one by one (e.g. a transformer's layers) before the root; without it every direct child
    #   that holds parameters is one block (components/core/trainer/parallel.py).


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
    missing = [m for m in ("build_model", "build_optimizer", "build_scheduler", "loss", "evaluate")
               if not callable(getattr(task, m, None))]
    if not any(callable(getattr(task, m, None)) for m in DATA_METHODS):
        missing.append(" or ".join(DATA_METHODS))
    if missing:
        raise BadInput(f"train.task: {spec!r} returned {type(task).__name__} without {', '.join(missing)}")
    check_task_options(task, config.train.task_options, spec)
    return task  # type: ignore[return-value]


DATA_METHODS = ("dataset", "build_dataset", "build_splits")


def task_options(task) -> dict[str, Any]:
    """The ``train.task_options`` keys ``task`` declares it reads, with their defaults."""
    declared = getattr(task, "options", None) or {}
    return dict(declared)


def check_task_options(task, given: dict[str, Any], spec: str, what: str = "train.task_options") -> None:
    """Refuse a ``train.task_options`` key the task does not read (one line naming it and the keys it reads).

    Raises:
        BadInput: an unknown key.
    """
    known = task_options(task)
    unknown = sorted(set(given) - set(known))
    if unknown:
        reads = f"it reads {', '.join(sorted(known))}" if known else "it reads none"
        raise BadInput(f"{what}.{unknown[0]}: the task {spec} does not read this option ({reads}); "
                       f"remove it or declare it in the task's options")
