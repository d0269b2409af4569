"""The launch backends (``local``, ``pytorchjob``, ``trainjob``, ``ray``, ``rayjob``; ``slurm`` renders only). Each is one
module implementing

    launch(config: RelaunchConfig, *, pipeline_run_id: str, resume_from: str | None) -> LaunchResult

and, for each ``relaunch render`` kind it offers, a function ``(config, run_id) -> str | dict`` (a
dict is written as YAML). :data:`LAUNCH_BACKENDS` is the one table of them: the config accepts a
``launch.backend`` it lists, ``relaunch.components.launch`` runs its module, ``relaunch render`` offers its
kinds. Adding a backend is its module plus one :func:`register_launch_backend` line in
:func:`relaunch.components.core.runtime.wiring.wire`, the one place that fills the table. The cluster backends share one contract, :mod:`relaunch.components.launchers.cluster`. Every
backend runs the one training entrypoint of the neutral :class:`relaunch.components.launchers.jobs.JobSpec`:
under torchrun (:meth:`~relaunch.components.launchers.jobs.JobSpec.torchrun_args`), under relaunch's in-place
agent (``train.memory_tier``, :mod:`~relaunch.components.launchers.inplace`), or in Ray actors that give it
torchrun's environment (:mod:`~relaunch.components.launchers.ray`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

from ..core.contract.registry import LAUNCH_BACKENDS, LaunchBackend, launch_backend  # noqa: F401
from ..core.contract.registry import register_launch_backend  # noqa: F401 - the seam, from here too
from ..core.contract.registry import launch_backend_names  # noqa: F401 - the names, from here too


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
    """The module of ``config.launch.backend`` (e.g. :mod:`~relaunch.components.launchers.local`)."""
    return importlib.import_module(launch_backend(config.launch.backend).module)


def renderers():
    """Every ``relaunch render`` kind -> a function ``(config, run_id) -> str | dict``, of every backend."""
    out = {}
    for backend in LAUNCH_BACKENDS.values():
        for kind, function in backend.renders.items():
            out[kind] = _lazy(backend.module, function)
    return out


def _lazy(module: str, function: str):
    def render(config, run_id: str):
        return getattr(importlib.import_module(module), function)(config, run_id)

    return render
