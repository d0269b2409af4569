"""What one attempt of the training builds before its loop, and where it starts.

Build, then act: :func:`check_world_size`, :func:`seed`, :func:`load_data` (the splits, the global-batch arithmetic and the data
order), :func:`build_model` (model, parallel wrapper, optimiser, scheduler, AMP scaler and the
checkpointed :class:`~relaunch.components.core.trainer.state.TrainingState`), :func:`open_checkpoints` (the manager,
one writer identity per training) and :func:`restore` (the start point every rank agrees on, loaded).
The loop itself is :class:`relaunch.components.train.Training`'s.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from relaunch.components.core.checkpoint import CheckpointManager
from relaunch.components.core.checkpoint.fingerprint import model_fingerprint
from relaunch.components.core.checkpoint.start import start_point
from relaunch.components.core.contract.errors import BadInput
from relaunch.components.core.store.datasets import read_dataset
from relaunch.components.core.tracking.warm_start import warm_start_checkpoint


def seed(config) -> None:
    """Seed Python, numpy and torch from ``train.seed``; deterministic kernels when asked."""
    import random

    random.seed(config.train.seed)
    np.random.seed(config.train.seed)
    torch.manual_seed(config.train.seed)
    if config.train.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        if torch.cuda.is_available() or "torch._inductor" in sys.modules:
            torch.use_deterministic_algorithms(True)
        else:
            # use_deterministic_algorithms imports torch._inductor (~1-3 s per restarted worker) only to set
            # a flag that matters to torch.compile; this documented alternative sets the one eager ops read
            torch.set_deterministic_debug_mode("error")
        torch.backends.cudnn.benchmark = False


@dataclass
class TrainData:
    """The splits and the data order: the global sample index ``step * global_batch_size`` into a
    seeded per-epoch permutation, each rank taking its slice of the global batch, so the order after
    a resume equals an uninterrupted run's at any world size."""

    splits: dict
    x: torch.Tensor
    y: torch.Tensor
    global_batch_size: int
    seed: int
    steps_per_epoch: int
    total_steps: int

    def permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.x))

    def batch(self, step: int, perm: np.ndarray, rank: int, world_size: int, device) -> dict[str, torch.Tensor]:
        g = self.global_batch_size
        start = (step % self.steps_per_epoch) * g
        local = perm[start + rank * (g // world_size): start + (rank + 1) * (g // world_size)]
        index = torch.from_numpy(local.astype(np.int64))
        return {"x": self.x[index].to(device), "y": self.y[index].to(device), "index": index,
                "step": torch.tensor(step, dtype=torch.int64)}


def check_world_size(config, world_size: int) -> None:
    """Refuse a global batch that does not divide by the world size (before any process group)."""
    if config.train.global_batch_size % world_size:
        raise BadInput(f"train.global_batch_size={config.train.global_batch_size} is not divisible by the world "
                       f"size {world_size}; pick a multiple")


def load_data(config, task, store) -> TrainData:
    """The stored dataset version (``data.version``), else the splits the task builds.

    Raises:
        BadInput: the global batch exceeds the training split.
    """
    t = config.train
    if config.data.version:
        splits = read_dataset(store, config.data.version)
    else:
        splits = task.build_splits()
    x = torch.from_numpy(np.ascontiguousarray(splits["train"]["x"]))
    y = torch.from_numpy(np.ascontiguousarray(splits["train"]["y"]))
    steps_per_epoch = len(x) // t.global_batch_size
    if steps_per_epoch == 0:
        raise BadInput(f"train.global_batch_size={t.global_batch_size} exceeds the {len(x)} training samples; "
                       "lower it")
    return TrainData(splits, x, y, t.global_batch_size, t.seed, steps_per_epoch,
                     t.max_steps or t.epochs * steps_per_epoch)


@dataclass
class ModelParts:
    """The model as built (``module``), as trained (``model``: DDP/FSDP-wrapped) and what is checkpointed."""

    module: torch.nn.Module
    model: torch.nn.Module
    optimizer: Any
    scheduler: Any
    scaler: Any
    state: Any  # TrainingState

    def optimizer_step(self) -> bool:
        """Step the optimiser (through the AMP scaler when there is one) and the schedule; whether
        the scaler skipped the step for an overflow."""
        overflowed = False
        if self.scaler is not None:
            scale = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            overflowed = self.scaler.get_scale() < scale
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()
        return overflowed


def build_model(config, task, device, total_steps: int, health: Any) -> ModelParts:
    """The task's model on ``device``, wrapped for ``train.parallelism``, its optimiser and schedule."""
    from relaunch.components.core.trainer.parallel import wrap_model
    from relaunch.components.core.trainer.state import TrainingState

    t = config.train
    module = task.build_model().to(device)
    model = wrap_model(module, parallelism=t.parallelism, device=device, mixed_precision=t.mixed_precision,
                       blocks=getattr(task, "shard_blocks", None))
    optimizer = task.build_optimizer(module)
    scheduler = task.build_scheduler(optimizer, total_steps)
    scaler = torch.amp.GradScaler("cuda") if t.amp and device.type == "cuda" else None
    state = TrainingState(module, optimizer, scheduler, scaler, extra={"health": health})
    return ModelParts(module, model, optimizer, scheduler, scaler, state)


def open_checkpoints(config, store, run_id: str | None, module: torch.nn.Module):
    """The training's CheckpointManager (collective): one writer identity per training, stable across
    torchrun restarts and pipeline retries, holding the store's write lease before the training
    decides where it starts (a second run is refused here, before it trains: BadInput, exit 2)."""
    t = config.train
    owner = os.environ.get("RELAUNCH_OWNER") or os.environ.get("RELAUNCH_PIPELINE_RUN_ID") or f"run:{run_id}"
    manager = CheckpointManager(store, keep_last=t.keep_last, keep_best=t.keep_best, best_metric=t.best_metric,
                                mode=t.best_mode, async_save=t.async_save, owner=owner,
                                model_fingerprint=model_fingerprint(module))
    try:
        manager.take_lease()
    except BaseException:
        manager.close()
        raise
    return manager


@dataclass
class Restored:
    """Where this attempt starts: ``uri`` ("" for a fresh start), the checkpoint loaded as the newest
    committed one (None otherwise), and the step the training continues from (-1: from scratch)."""

    uri: str
    committed: Any
    step: int


def restore(config, manager, parts: ModelParts, peers: Callable[[], Any]) -> Restored:
    """Decide the start point and load it on every rank: the whole training state, or the model's
    weights alone for a warm start. The decision is this, at this moment (rank 0 decides, every rank
    gets it): :func:`~relaunch.components.core.checkpoint.start.start_point`'s rule, so a group torchrun restarted
    resumes from the newest commit, whatever the locate step reported before. ``peers()`` wraps the
    collectives (a peer dying in them is a retryable failure)."""
    from relaunch.components.core.trainer.state import ModelWeights

    with peers():
        start = start_point(config, manager, warm_start_lookup=warm_start_checkpoint)
    uri, committed = start.uri, None
    with peers():
        if start.weights_only:
            manager.load(ModelWeights(parts.module), uri=uri)
        elif start.source == "latest":  # a checkpoint found damaged while read: the previous one, together
            committed = manager.load(parts.state)
            uri = committed.uri if committed is not None else ""
        elif uri:
            manager.load(parts.state, uri=uri)
    step = int(parts.state.step) if uri and not start.weights_only else -1
    return Restored(uri, committed, step)
