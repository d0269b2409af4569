"""The pipeline's steps (one module each) and the libraries they share (``components.core``).

This is the one table of the steps: the KFP and Argo pipelines, the retry table
(:data:`components.core.exitcodes.RETRY_POLICIES`), the local run and the tests read each step's
name, module and outputs from here.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Step:
    """One task of the pipeline."""

    name: str
    """Kebab-case task name, the same in KFP and Argo."""
    module: str
    """The module whose ``run(config, **inputs)`` the task calls (``python -m <module>`` on Argo)."""
    outputs: str
    """The dataclass ``run`` returns, defined in ``module``: the task's outputs, in order."""
    uses_torch: bool = False
    """The step, or a process it starts, imports torch (``relaunch run`` forks it from the warm server
    that loaded torch; the others from the one that did not, which is ready seconds sooner)."""

    def outputs_class(self) -> type:
        return getattr(importlib.import_module(self.module), self.outputs)

    def output_fields(self) -> list[tuple[str, type]]:
        """``[(name, type), ...]`` of the outputs, in order (what KFP's return annotation must say)."""
        import typing

        hints = typing.get_type_hints(self.outputs_class())
        return [(f.name, hints[f.name]) for f in dataclasses.fields(self.outputs_class())]


PREPARE = Step("prepare", "components.prepare", "PrepareOutputs")
LOCATE = Step("locate-latest-checkpoint", "components.locate", "LocateOutputs")
LAUNCH = Step("launch", "components.launch", "LaunchOutputs", uses_torch=True)
EVALUATE = Step("evaluate", "components.evaluate", "EvaluateOutputs", uses_torch=True)
REGISTER = Step("register", "components.register", "RegisterOutputs")
FINALIZE = Step("finalize", "components.finalize", "FinalizeOutputs")
"""The exit handler's task: it runs whatever the steps did."""

STEP_TABLE: dict[str, Step] = {s.name: s for s in (PREPARE, LOCATE, LAUNCH, EVALUATE, REGISTER, FINALIZE)}
"""Every task by name, in pipeline order, the exit task last."""
STEPS: tuple[str, ...] = tuple(s.name for s in (PREPARE, LOCATE, LAUNCH, EVALUATE, REGISTER))
"""The five retried steps of the DAG, in order."""
STEP_MODULES: dict[str, str] = {name: s.module for name, s in STEP_TABLE.items()}
