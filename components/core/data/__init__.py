"""The data path: datasets committed as shards in the store (:mod:`.shards`), the global sample order
(:mod:`.order`) and the loaders a training rank streams its batches from (:mod:`.loader`).

Where a task's data comes from, in this order of its methods:

- ``dataset(split, rank, world_size)``: the task's own map-style or iterable ``Dataset``, or its own
  stateful loader; nothing is committed by relaunch;
- ``build_dataset()``: a :class:`DatasetSource` that prepare commits as shards (a corpus too large for
  memory streams through it chunk by chunk);
- ``build_splits()``: whole arrays per split (small data), committed as shards the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..contract.errors import BadInput
from .shards import (DatasetSource, Manifest, arrays_source, commit_source,
                     dataset_uri, read_manifest)

if TYPE_CHECKING:
    from .loader import SplitData

# The loaders (:mod:`.loader`) import torch: prepare commits a dataset in a process without it, so they
# are imported by the functions that make one.

__all__ = ["DatasetSource", "Manifest", "TrainData", "commit_task_data", "dataset_uri", "own_dataset",
           "open_split", "open_training_data", "preview_split", "read_manifest", "step_counts"]


def own_dataset(task) -> bool:
    """Whether the task hands relaunch its own dataset or loader (nothing to commit)."""
    return callable(getattr(task, "dataset", None))


def task_source(task) -> DatasetSource:
    if callable(getattr(task, "build_dataset", None)):
        return task.build_dataset()
    if callable(getattr(task, "build_splits", None)):
        return arrays_source(task.build_splits())
    raise BadInput(f"train.task: {type(task).__name__} has none of dataset(), build_dataset() or build_splits(); "
                   "a task must say where its data comes from")


def commit_task_data(task, store) -> tuple[Manifest | None, int]:
    """Commit the task's data as a dataset version (found, not built, when its source was committed
    before): the manifest (None for a task's own dataset) and the objects written."""
    if own_dataset(task):
        return None, 0
    return commit_source(store, task_source(task))


@dataclass
class TrainData:
    """What a rank trains on: its loader, the global-batch arithmetic and the version it reads."""

    loader: Any  # a Loader
    global_batch_size: int
    steps_per_epoch: int
    total_steps: int
    version: str | None
    samples: int | None


def _steps(config, samples: int | None) -> tuple[int, int]:
    t = config.train
    if samples is None:
        if not t.max_steps:
            raise BadInput("the task's dataset has no length, so epochs cannot be counted: set train.max_steps")
        return t.max_steps, t.max_steps
    steps_per_epoch = samples // t.global_batch_size
    if steps_per_epoch == 0:
        raise BadInput(f"train.global_batch_size={t.global_batch_size} exceeds the {samples} training samples; lower it")
    return steps_per_epoch, t.max_steps or t.epochs * steps_per_epoch


def step_counts(config, task) -> tuple[int, int]:
    """``(steps_per_epoch, total_steps)`` of a training of ``task`` with ``config``, counted from the
    task's own data without committing it (a checkpoint imported from outside relaunch).

    Raises:
        BadInput: the global batch exceeds the training split, or no count is possible (set max_steps).
    """
    if own_dataset(task):
        source = task.dataset("train", 0, 1)
        try:
            samples = len(source)
        except TypeError:
            samples = None
    else:
        samples = sum(len(next(iter(chunk.values()))) for chunk in task_source(task).splits["train"]())
    return _steps(config, samples)


def open_training_data(config, task, store, version: str | None, rank: int, world_size: int) -> TrainData:
    """The train split's loader for ``rank``: from the committed ``version``, or the task's own dataset."""
    from .loader import IterableLoader, MapLoader, ShardLoader

    t, d = config.train, config.data
    common = {"num_workers": d.num_workers, "prefetch_batches": d.prefetch_batches, "seed": t.seed}
    if own_dataset(task):
        source = task.dataset("train", rank, world_size)
        import torch

        if isinstance(source, torch.utils.data.Dataset) and not isinstance(source, torch.utils.data.IterableDataset):
            spe, total = _steps(config, len(source))
            loader = MapLoader(source, steps_per_epoch=spe, total_steps=total, global_batch=t.global_batch_size,
                               rank=rank, world_size=world_size, **common)
            return TrainData(loader, t.global_batch_size, spe, total, None, len(source))
        spe, total = _steps(config, None)
        loader = IterableLoader(source, local_batch=t.global_batch_size // world_size, world_size=world_size, **common)
        return TrainData(loader, t.global_batch_size, spe, total, None, None)
    manifest = read_manifest(store, version)
    samples = manifest.samples("train")
    spe, total = _steps(config, samples)
    loader = ShardLoader(config.store.uri, manifest, "train", steps_per_epoch=spe, total_steps=total,
                         global_batch=t.global_batch_size, rank=rank, world_size=world_size, **common)
    return TrainData(loader, t.global_batch_size, spe, total, version, samples)


def preview_split(task, split: str, samples: int = 64) -> SplitData:
    """The first ``samples`` of a split, built by the task without committing anything (a check of
    the metrics a task's evaluate gives, before a study writes anything)."""
    import numpy as np

    from .loader import SplitData

    if own_dataset(task):
        return SplitData(dataset=torch_subset(task.dataset(split, 0, 1), samples))
    source = task_source(task)
    if split not in source.splits:
        raise BadInput(f"the task's data has no split {split!r} (it has {', '.join(sorted(source.splits))})")
    chunk = next(iter(source.splits[split]()))
    writer_rows = {name: np.asarray(a)[:samples] for name, a in chunk.items()}
    dtype = np.dtype([(name, a.dtype, a.shape[1:]) for name, a in writer_rows.items()])
    rows = np.empty(len(next(iter(writer_rows.values()))), dtype=dtype)
    for name, a in writer_rows.items():
        rows[name] = a
    return SplitData(rows=rows)


def torch_subset(dataset, samples: int):
    import itertools

    import torch

    if isinstance(dataset, torch.utils.data.IterableDataset):
        return list(itertools.islice(iter(dataset), samples))
    if isinstance(dataset, torch.utils.data.Dataset):
        return torch.utils.data.Subset(dataset, range(min(samples, len(dataset))))
    return list(itertools.islice(iter(dataset), 1))  # an own loader: its first batch


def open_split(config, task, store, version: str | None, split: str) -> SplitData:
    """A held-out split for evaluation (rank 0's view of a task's own dataset)."""
    from .loader import SplitData

    if own_dataset(task):
        return SplitData(dataset=task.dataset(split, 0, 1))
    return SplitData(store, read_manifest(store, version), split)
