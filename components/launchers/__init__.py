"""The launch backends (``local``, ``pytorchjob``, ``trainjob``). Each implements one function:

    launch(config: RelaunchConfig, *, pipeline_run_id: str, resume_from: str | None) -> LaunchResult

``components.launch`` picks the backend from ``config.launch.backend``; nothing else differs. The two
cluster backends share one contract, :mod:`components.launchers.cluster`; every backend runs the one
torchrun command of :mod:`components.launchers.torchrun`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field


@dataclass
class LaunchResult:
    """How a training launch ended, already mapped to the exit-code contract."""

    exit_code: int
    message: str = ""
    restarts: int = 0
    resumed_from_steps: list[int] = field(default_factory=list)
    duration_seconds: float = 0.0
    job_name: str | None = None


def backend_module(config):
    """The module of ``config.launch.backend``: :mod:`~components.launchers.local`, ``pytorchjob`` or ``trainjob``."""
    return importlib.import_module(f"components.launchers.{config.launch.backend}")
