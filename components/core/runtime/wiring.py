"""The one place that wires a process: it fills the tables the configuration validates against
(:mod:`relaunch.components.core.contract.registry`): the store URI rules and the launch backends.

Nothing fills them when imported. Every entry point calls :func:`wire` before it reads a configuration:
each step's CLI (:func:`relaunch.components.core.runtime.stepcli.step_main`), the training worker
(``relaunch.components.train``), the launchers' own commands (supervise, the in-place agent, torchrun's
and Ray's), ``relaunch`` (:mod:`relaunch.pipelines.cli`), the KFP entry (:mod:`relaunch.pipelines.kfp_entry`),
the packaged model's loader and the tests' conftest. A process that forgets refuses its first
configuration, naming this function.

It sits in the runtime room, the lowest that sees the store (whose URI rules it registers); the launch
backends are named here, by the module that implements each, which the launchers import when one is used
(:func:`relaunch.components.launchers.backend_module`). Adding a backend is its module in ``launchers/``
and one :func:`register_launch_backend` line below.
"""

from __future__ import annotations

from ..contract.registry import register_launch_backend, register_store_uri_parser
from ..store import parse_store_uri


def wire() -> None:
    """Fill this process's tables; calling it again changes nothing."""
    register_store_uri_parser(parse_store_uri)
    register_launch_backend("local", "relaunch.components.launchers.local", in_place=True)
    register_launch_backend("pytorchjob", "relaunch.components.launchers.pytorchjob", cluster=True,
                            renders={"pytorchjob": "render"}, in_place=True)
    register_launch_backend("trainjob", "relaunch.components.launchers.trainjob", cluster=True,
                            renders={"trainjob": "render", "trainingruntime": "render_training_runtime"}, in_place=True)
    register_launch_backend("slurm", "relaunch.components.launchers.slurm", launches=False, renders={"slurm": "render"})
    register_launch_backend("ray", "relaunch.components.launchers.ray")
    register_launch_backend("rayjob", "relaunch.components.launchers.rayjob", cluster=True, renders={"rayjob": "render"})
    register_launch_backend("katib", "relaunch.components.launchers.katib", cluster=True, launches=False,
                            renders={"katib": "render"})
    register_launch_backend("optimizationjob", "relaunch.components.launchers.optimizationjob", cluster=True,
                            launches=False, renders={"optimizationjob": "render"})
