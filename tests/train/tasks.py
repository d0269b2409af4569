"""User tasks written for the tests: the digits task with a sample tracer, a NaN, or a slow save."""

from __future__ import annotations

import json
import os
import time

import torch

from docs.examples.own_data import DigitStream, IterableTask
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


class KillingStream(DigitStream):
    """docs/examples/own_data.py's IterableDataset; with $KILL_LOADER_AT set, the loader worker that is to
    yield that sample index SIGKILLs itself first, once (a marker file beside it says it happened)."""

    def __iter__(self):
        kill_at, marker = os.environ.get("KILL_LOADER_AT"), os.environ.get("KILL_LOADER_MARKER", "")
        for sample in super().__iter__():
            if kill_at is not None and int(sample["index"]) == int(kill_at) and marker and not os.path.exists(marker):
                open(marker, "w").close()
                os.kill(os.getpid(), 9)
            yield sample


class OwnIterableTask(IterableTask):
    """docs/examples/own_data.py's task handing relaunch its own IterableDataset, whose worker may kill itself."""

    def dataset(self, split: str, rank: int, world_size: int):
        if split != "train":
            return super().dataset(split, rank, world_size)
        arrays = self.build_splits()[split]
        return KillingStream(arrays["x"], arrays["y"], rank, world_size, self.config.train.seed)


def own_iterable_task(config):
    return OwnIterableTask(config)
