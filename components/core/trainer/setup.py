"""What one attempt of the training builds before its loop.

Build, then act: :func:`check_world_size`, :func:`seed`, :func:`load_data` (this rank's loader over the
committed dataset, the global-batch arithmetic), :func:`build_model` (model, parallel wrapper, optimiser, scheduler, AMP scaler and the
checkpointed :class:`~relaunch.components.core.trainer.state.TrainingState`), :func:`open_checkpoints` (the manager,
one writer identity per training). Where it starts is the recovery room's
(:func:`relaunch.components.core.recovery.start.start`).
The loop itself is :class:`relaunch.components.train.Training`'s.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..checkpoint import CheckpointManager
from ..checkpoint.fingerprint import model_fingerprint
from ..contract.errors import BadInput
from ..data import TrainData, commit_task_data, open_split, open_training_data, own_dataset


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


def check_world_size(config, world_size: int) -> None:
    """Refuse a global batch that does not divide by the world size, into ``train.grad_accum_steps``
    micro-batches each (before any process group)."""
    t = config.train
    if t.global_batch_size % world_size:
        raise BadInput(f"train.global_batch_size={t.global_batch_size} is not divisible by the world "
                       f"size {world_size}; pick a multiple")
    if t.global_batch_size % (world_size * t.grad_accum_steps):
        raise BadInput(f"train.global_batch_size={t.global_batch_size} does not split into "
                       f"train.grad_accum_steps={t.grad_accum_steps} micro-batches on each of {world_size} ranks; "
                       f"pick a multiple of {world_size * t.grad_accum_steps}")


def committed_version(config, task, store) -> str | None:
    """Rank 0: the dataset version the training reads: ``data.version`` (prepare's), else the task's
    data committed here as prepare does (a worker started by hand); None for a task's own dataset."""
    if config.data.version is not None or own_dataset(task):
        return config.data.version
    return commit_task_data(task, store)[0].version


def load_data(config, task, store, version: str | None, rank: int, world_size: int) -> TrainData:
    """This rank's loader over the train split of the committed ``version`` (or the task's own dataset).

    Raises:
        BadInput: the global batch exceeds the training split, or the task's data is unusable.
    """
    return open_training_data(config, task, store, version, rank, world_size)


def validation_split(config, task, store, data: TrainData):
    """The split validation reads (``val``), streamed from the version the training reads."""
    return open_split(config, task, store, data.version, "val")


def to_device(batch: Any, device) -> Any:
    """A batch's tensors on ``device`` (a dict, list or tuple of them; the rest as it is)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def micro_batches(batch: Any, count: int) -> list[Any]:
    """``batch`` cut into ``count`` micro-batches along its first dimension (a dict's tensors with one;
    0-d values such as ``step`` go to each); ``[batch]`` for one."""
    if count == 1:
        return [batch]
    if not isinstance(batch, dict):
        raise BadInput("train.grad_accum_steps > 1 needs batches that are dicts of tensors")
    parts: list[dict[str, Any]] = [{} for _ in range(count)]
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            if len(value) % count:
                raise BadInput(f"train.grad_accum_steps={count} does not divide this rank's batch of {len(value)}")
            for part, chunk in zip(parts, value.chunk(count)):
                part[key] = chunk
        else:
            for part in parts:
                part[key] = value
    return parts


def gradient_sync(model: torch.nn.Module, sync: bool):
    """Around a micro-batch's backward: gradients are reduced across ranks only on the last one (DDP's
    ``no_sync``; FSDP2's ``set_requires_gradient_sync``)."""
    import contextlib

    if sync:
        return contextlib.nullcontext()
    if hasattr(model, "no_sync"):
        return model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):
        @contextlib.contextmanager
        def held():
            model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                model.set_requires_gradient_sync(True)
        return held()
    return contextlib.nullcontext()


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


def build_model(config, task, device, total_steps: int, health: Any, loader: Any = None) -> ModelParts:
    """The task's model on ``device``, wrapped for ``train.parallelism``, its optimiser and schedule;
    ``loader`` (this rank's) is checkpointed with the state."""
    from .parallel import wrap_model
    from .state import TrainingState

    t = config.train
    module = task.build_model().to(device)
    model = wrap_model(module, parallelism=t.parallelism, device=device, mixed_precision=t.mixed_precision,
                       blocks=getattr(task, "shard_blocks", None))
    optimizer = task.build_optimizer(module)
    scheduler = task.build_scheduler(optimizer, total_steps)
    scaler = torch.amp.GradScaler("cuda") if t.amp and device.type == "cuda" else None
    state = TrainingState(module, optimizer, scheduler, scaler, extra={"health": health}, loader=loader)
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
