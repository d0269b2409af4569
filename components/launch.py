"""Step 3, ``launch``: run the training with the backend ``launch.backend`` names and wait for it.

``local`` starts torchrun agents on this machine (:mod:`relaunch.components.launchers.local`); ``pytorchjob``
submits one Kubeflow PyTorchJob (:mod:`relaunch.components.launchers.pytorchjob`) and ``trainjob`` one Kubeflow
Trainer v2 TrainJob (:mod:`relaunch.components.launchers.trainjob`).
Each is one function with the same shape; this step only picks it, reads the trainer's summary from the store, and fails with the
contract's exit code when the training did not end well (a retried launch resumes from the latest
checkpoint, because the trainer always does).

    python -m relaunch.components.launch --config configs/local.yaml --input pipeline_run_id=manual
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

from .core.contract.config import RelaunchConfig
from .core.contract.errors import RelaunchError
from .core.store.records import read_summary as read
from .core.store.ledger import completed, reached_its_end
from .core.tracking.context import Context
from .launchers import backend_module


@dataclass
class LaunchOutputs:
    """What a launch that ended well reports (a failed one exits with its code: :class:`LaunchFailed`)."""

    restarts: int
    resumed_from_steps: str  # JSON list: the step each attempt started from (-1 = fresh)
    train_seconds: float
    duration_seconds: float
    ettr: float
    last_checkpoint_uri: str
    job_name: str
    completed: bool = False
    """The training trained exactly its last step (:func:`completed`): the gate of evaluate and register."""


class LaunchFailed(RelaunchError):
    """The training ended with a non-zero code of the contract; the step exits with that code."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.exit_code = code


def run(config: RelaunchConfig, resume_from: str = "", pipeline_run_id: str = "") -> LaunchOutputs:
    """Launch the training and wait for its end.

    Raises:
        LaunchFailed: the training's exit code (retryable ones make the pipeline retry this step).
    """
    context = Context(config)
    trained = finished_training(context)
    if trained is not None:
        return trained
    backend = backend_module(config)  # local | pytorchjob | trainjob
    result = backend.launch(config, pipeline_run_id=pipeline_run_id, resume_from=resume_from or None)
    if result.exit_code != 0:
        raise LaunchFailed(result.exit_code, result.message or f"training failed with exit code {result.exit_code}")
    summary = read_summary(context)
    done = completed(summary)
    if not done:
        print(f"launch: the training ended without reaching its end (step {summary.get('last_step')} of "
              f"{summary.get('total_steps')}); nothing of it is evaluated or registered", file=sys.stderr)
    return LaunchOutputs(
        restarts=result.restarts,
        resumed_from_steps=json.dumps(summary.get("resumed_from_steps", result.resumed_from_steps)),
        train_seconds=float(summary.get("train_seconds", 0.0)), duration_seconds=result.duration_seconds,
        ettr=float(summary.get("ettr", 0.0)), last_checkpoint_uri=str(summary.get("last_checkpoint_uri") or ""),
        job_name=result.job_name or "", completed=done)


def finished_training(context: Context) -> LaunchOutputs | None:
    """The outputs of this MLflow run's training when it already reached its end, else None.

    That is a pipeline run again after its training ended (``relaunch run --resume`` after evaluate
    or register failed, or a launch retried after the training ended): nothing is launched, so no
    attempt is added and the run's restarts and goodput stay those of the real training.
    """
    config, summary = context.config, read_summary(context)
    if not config.tracking.run_id or summary.get("run_id") != config.tracking.run_id or not reached_its_end(summary):
        return None
    print(f"launch: the training of MLflow run {config.tracking.run_id} already reached its end (step "
          f"{summary['last_step']} of {summary['total_steps']}); nothing to launch", file=sys.stderr)
    return LaunchOutputs(
        restarts=max(0, int(summary.get("attempts") or 1) - 1),
        resumed_from_steps=json.dumps(summary.get("resumed_from_steps", [])),
        train_seconds=float(summary.get("train_seconds", 0.0)), duration_seconds=0.0,
        ettr=float(summary.get("ettr") or 0.0), last_checkpoint_uri=str(summary.get("last_checkpoint_uri") or ""),
        job_name="", completed=completed(summary))


def read_summary(context: Context) -> dict:
    """The trainer's ``runs/summary.json`` in the store ({} when it wrote none)."""
    return read(context.store) or {}


if __name__ == "__main__":
    from .core.contract import steps
    from .core.runtime.stepcli import step_main

    sys.exit(step_main(steps.LAUNCH, run))
