"""User tasks written for the tests: the digits task with a sample tracer, a NaN, or a slow save."""

from __future__ import annotations

import json
import os
import time

import torch

from relaunch.components.tasks.digits import DigitsTask


class TracingTask(DigitsTask):
    """Appends (rank, world size, step, sample indices) of every batch to $TRACE_DIR/<pid>.jsonl."""

    def loss(self, model, batch):
        folder = os.environ["TRACE_DIR"]
        with open(os.path.join(folder, f"{os.getpid()}.jsonl"), "a") as fh:
            fh.write(json.dumps({"rank": int(os.environ.get("RANK", 0)), "world": int(os.environ.get("WORLD_SIZE", 1)),
                                 "step": int(batch["step"]), "index": batch["index"].tolist()}) + "\n")
        return super().loss(model, batch)


class NanTask(DigitsTask):
    """The loss becomes NaN from step $NAN_AT_STEP on."""

    def loss(self, model, batch):
        loss = super().loss(model, batch)
        if int(batch["step"]) >= int(os.environ.get("NAN_AT_STEP", "25")):
            return loss * torch.tensor(float("nan"))
        return loss


class HangingTask(DigitsTask):
    """The last rank stops making progress at step $HANG_AT_STEP (a stuck data loader, a dead NFS)."""

    def loss(self, model, batch):
        if int(batch["step"]) == int(os.environ.get("HANG_AT_STEP", "15")) and \
                os.environ.get("RANK") == str(int(os.environ.get("WORLD_SIZE", "1")) - 1):
            time.sleep(3600)
        return super().loss(model, batch)


def hanging_task(config):
    return HangingTask(config)


def tracing_task(config):
    return TracingTask(config)


def nan_task(config):
    return NanTask(config)


class OwnRows(torch.utils.data.IterableDataset):
    """A user's own IterableDataset: the digits training rows of one rank (every world_size-th), in an
    order shuffled per epoch (``set_epoch``), each worker taking every num_workers-th of them. With
    $KILL_LOADER_AT set, the worker that is to yield that sample index SIGKILLs itself first, once
    (a marker file beside it says it happened)."""

    def __init__(self, x, y, rank: int, world_size: int, seed: int):
        self.x, self.y, self.rank, self.world, self.seed, self.epoch = x, y, rank, world_size, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        import numpy as np

        order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.x))[self.rank::self.world]
        info = torch.utils.data.get_worker_info()
        if info is not None:
            order = order[info.id::info.num_workers]
        kill_at, marker = os.environ.get("KILL_LOADER_AT"), os.environ.get("KILL_LOADER_MARKER", "")
        for i in order:
            if kill_at is not None and int(i) == int(kill_at) and marker and not os.path.exists(marker):
                open(marker, "w").close()
                os.kill(os.getpid(), 9)
            yield {"x": torch.from_numpy(self.x[i]), "y": torch.tensor(int(self.y[i])), "index": torch.tensor(int(i))}


class OwnIterableTask(DigitsTask):
    """The digits task handing relaunch its own IterableDataset (:class:`OwnRows`) instead of its arrays."""

    def dataset(self, split: str, rank: int, world_size: int):
        arrays = self.build_splits()[split]
        if split != "train":
            return torch.utils.data.TensorDataset(torch.from_numpy(arrays["x"]), torch.from_numpy(arrays["y"]))
        return OwnRows(arrays["x"], arrays["y"], rank, world_size, self.config.train.seed)

    def evaluate(self, model, split):
        import numpy as np

        arrays = next(iter(split.batches(100_000)))  # a TensorDataset's one batch: [x, y]
        return super().evaluate(model, {"x": arrays[0].numpy(), "y": arrays[1].numpy().astype(np.int64)})


def own_iterable_task(config):
    return OwnIterableTask(config)
