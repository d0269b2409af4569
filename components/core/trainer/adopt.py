"""A stock ``torch.distributed.checkpoint.save`` of a model and its optimizer, made into the state a
training of a task resumes from (``relaunch checkpoints import``).

Such a folder holds ``{"model", "optimizer"}`` and none of what a training's checkpoint also holds:
its progress (step, epoch, samples seen), its learning-rate schedule, its health counters. They are
built here as the task's training builds them: the task's model and optimizer take the folder's
values, the schedule is built on them and advanced to the step, and the progress says that step
(the epoch derived from it by the task's data, as the training loop derives it).
"""

from __future__ import annotations

import warnings
from typing import Any

from ..contract.errors import BadInput


def training_state(folder: dict[str, Any], config: Any, step: int, source: str) -> Any:
    """The :class:`~relaunch.components.core.trainer.state.TrainingState` of ``config``'s task at ``step``
    holding the model (and optimizer, when the folder has one) of ``folder`` (a stock DCP folder's
    state, nested as saved).

    Raises:
        BadInput: the folder's model or optimizer does not fit the task's, or ``step`` is past the
            training's total steps.
    """
    import torch
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    from ..data import step_counts
    from .health import SpikeDetector
    from .state import TrainingState
    from ...tasks.base import load_task

    task = load_task(config.train.task, config)
    steps_per_epoch, total_steps = step_counts(config, task)
    if step > total_steps:
        raise BadInput(f"--step {step} is past the {total_steps} steps of a training of {config.train.task} "
                       f"with this configuration; import at a step up to {total_steps}")
    module = task.build_model()
    optimizer = task.build_optimizer(module)
    try:
        if isinstance(folder.get("optimizer"), dict):
            set_state_dict(module, optimizer, model_state_dict=folder["model"], optim_state_dict=folder["optimizer"])
        else:
            set_model_state_dict(module, folder["model"])
    except (RuntimeError, KeyError, ValueError, TypeError) as err:
        first = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
        raise BadInput(f"{source} does not fit the model and optimizer of train.task={config.train.task} "
                       f"({first}); pass the --config/--set of the training that is to resume from it") from None
    scheduler = task.build_scheduler(optimizer, total_steps)
    if scheduler is not None:
        with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()": no optimizer step here
            warnings.simplefilter("ignore")
            for _ in range(step):
                scheduler.step()
    state = TrainingState(module, optimizer, scheduler, None,
                          extra={"health": SpikeDetector(config.train.loss_spike_factor)})
    epoch = step // steps_per_epoch
    state.step, state.epoch = step, epoch
    state.samples_seen, state.sampler_epoch = step * config.train.global_batch_size, epoch
    torch.manual_seed(config.train.seed)  # the saved RNG stream: the one a fresh training starts with
    return state
