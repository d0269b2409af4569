"""The typed parameters of the KFP and Argo pipelines: each overrides one configuration field
(:data:`PIPELINE_PARAMETERS`), has that field's type and description, and keeps the configuration's value
when left at its "keep" value. The pipeline renderings (``relaunch.pipelines``) declare them from here;
the prepare step folds the values a run was given into its configuration (:func:`with_pipeline_parameters`).
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from .config import RelaunchConfig, config_field
from .errors import BadInput

PIPELINE_PARAMETERS: dict[str, str] = {
    "epochs": "train.epochs",
    "max_steps": "train.max_steps",
    "learning_rate": "train.lr",
    "nodes": "launch.nodes",
    "procs_per_node": "launch.procs_per_node",
    "inject_failure": "launch.inject_failure",
    "resume_from": "train.resume_from",
    "warm_start_model": "train.warm_start_model",
    "run_name": "tracking.run_name",
}
"""Typed pipeline parameter -> the configuration field it overrides: the one table the KFP and Argo
parameters (their types, "keep" defaults and descriptions) and prepare's folding are built from."""

KEEP_VALUES = (None, "", 0, 0.0, "0", "0.0")
"""A pipeline parameter holding one of these keeps the configuration's value (Argo passes text)."""


def pipeline_parameter_type(name: str) -> type:
    """``int``, ``float`` or ``str``: the type of the field parameter ``name`` overrides, less ``None``."""
    annotation = config_field(PIPELINE_PARAMETERS[name]).annotation
    return next(t for t in (int, float, str) if t is annotation or t in getattr(annotation, "__args__", ()))


def pipeline_parameter_description(name: str) -> str:
    """``train.epochs: Passes over the training split. 0 keeps the configuration's value.``"""
    path = PIPELINE_PARAMETERS[name]
    keep = "Empty" if pipeline_parameter_type(name) is str else "0"
    return f"{path}: {config_field(path).description} {keep} keeps the configuration's value."


def with_pipeline_parameters(config: RelaunchConfig, values: dict[str, Any]) -> RelaunchConfig:
    """A copy of ``config`` with the pipeline parameters that differ from their "keep" value.

    Each value is validated once, by assignment to its field (no text round trip); the rest of the
    configuration was validated when it was loaded.

    Raises:
        BadInput: an unknown parameter, or a value its field refuses (named in one line).
    """
    unknown = sorted(set(values) - set(PIPELINE_PARAMETERS))
    if unknown:
        raise BadInput(f"unknown pipeline parameter(s) {', '.join(unknown)}; known: {', '.join(PIPELINE_PARAMETERS)}")
    changed = {name: v for name, v in values.items() if v not in KEEP_VALUES}
    if not changed:
        return config
    folded = config.model_copy(deep=True)
    for name, value in changed.items():
        *sections, field = PIPELINE_PARAMETERS[name].split(".")
        target = folded
        for section in sections:
            target = getattr(target, section)
        try:
            setattr(target, field, value)
        except ValidationError as err:
            first = err.errors()[0]
            raise BadInput(f"config: {PIPELINE_PARAMETERS[name]} (pipeline parameter {name}): "
                           f"{first['msg'].removeprefix('Value error, ')} (got {value!r})") from None
    return folded
