"""Your own data, three ways: each class below is a complete relaunch task (docs/data.md).

    relaunch run --set train.task=own_data:map_style_task        # with docs/examples on PYTHONPATH
    relaunch run --set train.task=own_data:iterable_task
    relaunch run --set train.task=own_data:stateful_loader_task

Each is the built-in digits task (components/tasks/digits.py: its model, optimiser and maths) with its
data handed to relaunch by a ``dataset(split, rank, world_size)`` method instead of whole arrays; only
that method (and the classes it returns) is what a task of your own writes. tests/train/test_own_data.py
trains each, stops it mid-epoch and resumes it bitwise equal to an uninterrupted run.
"""

from __future__ import annotations

import numpy as np
import torch

from relaunch.components.tasks.digits import DigitsTask


class DigitRows(torch.utils.data.Dataset):
    """A map-style dataset: ``len()`` samples, each one by its index. relaunch orders the indices itself
    (a seeded permutation per epoch), gives each rank its slice of every global batch and fetches them in
    its loader worker processes: a resume at any world size continues at the same global sample."""

    def __init__(self, x: np.ndarray, y: np.ndarray):
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": torch.from_numpy(self.x[i]), "y": torch.tensor(int(self.y[i]))}


class DigitStream(torch.utils.data.IterableDataset):
    """An iterable dataset: it decides its own order and shards itself, by rank (every world_size-th
    sample) and by loader worker (``get_worker_info``); ``set_epoch`` gives it the epoch. relaunch reads
    it through torchdata's ``StatefulDataLoader``, whose state (each worker's position, what was
    prefetched) is checkpointed per rank: it resumes exactly at the world size it was saved at."""

    def __init__(self, x: np.ndarray, y: np.ndarray, rank: int, world_size: int, seed: int):
        self.x, self.y, self.rank, self.world_size, self.seed, self.epoch = x, y, rank, world_size, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.x))[self.rank::self.world_size]
        worker = torch.utils.data.get_worker_info()
        if worker is not None:
            order = order[worker.id::worker.num_workers]
        for i in order:
            yield {"x": torch.from_numpy(self.x[i]), "y": torch.tensor(int(self.y[i])), "index": torch.tensor(int(i))}


class DigitBatches:
    """A stateful loader of your own: iterable over whole batches, with ``state_dict`` and
    ``load_state_dict`` (relaunch checkpoints them per rank, in the store and in the memory tier's
    snapshot, and calls ``set_epoch`` before each pass)."""

    def __init__(self, x: np.ndarray, y: np.ndarray, batch_size: int, rank: int, world_size: int, seed: int):
        self.x, self.y, self.batch_size, self.seed = x, y, batch_size, seed
        self.rank, self.world_size, self.epoch, self.position = rank, world_size, 0, 0

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self.position = epoch, 0

    def __iter__(self):
        order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.x))[self.rank::self.world_size]
        while self.position + self.batch_size <= len(order):
            rows = order[self.position:self.position + self.batch_size]
            self.position += self.batch_size
            yield {"x": torch.from_numpy(self.x[rows]), "y": torch.from_numpy(self.y[rows])}
        self.position = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position = state["epoch"], state["position"]


class MapStyleTask(DigitsTask):
    def dataset(self, split: str, rank: int, world_size: int) -> DigitRows:
        arrays = self.build_splits()[split]
        return DigitRows(arrays["x"], arrays["y"])


class IterableTask(DigitsTask):
    def dataset(self, split: str, rank: int, world_size: int):
        arrays = self.build_splits()[split]
        if split != "train":  # evaluation reads a held-out split whole, on one process
            return DigitRows(arrays["x"], arrays["y"])
        return DigitStream(arrays["x"], arrays["y"], rank, world_size, self.config.train.seed)


class StatefulLoaderTask(DigitsTask):
    def dataset(self, split: str, rank: int, world_size: int):
        arrays = self.build_splits()[split]
        if split != "train":
            return DigitRows(arrays["x"], arrays["y"])
        local_batch = self.config.train.global_batch_size // world_size
        return DigitBatches(arrays["x"], arrays["y"], local_batch, rank, world_size, self.config.train.seed)


def map_style_task(config) -> MapStyleTask:
    return MapStyleTask(config)


def iterable_task(config) -> IterableTask:
    return IterableTask(config)


def stateful_loader_task(config) -> StatefulLoaderTask:
    return StatefulLoaderTask(config)
