"""The relaunch pipeline as Kubeflow Pipelines v2: prepare -> locate-latest-checkpoint -> launch ->
evaluate -> register (only when evaluate's gate passed), inside an exit handler whose ``finalize``
task closes the MLflow run (FAILED when the pipeline failed). Wiring only: each component body
imports :func:`pipelines.kfp_entry.call`, which runs the step's ``run``.

    python -m pipelines.kfp_pipeline build/pipeline.kfp.yaml     # or: relaunch compile --target kfp

:func:`build_pipeline` makes the components and the pipeline for one configuration: its image is
each component's ``base_image`` (KFP's own setting, nothing rewritten afterwards) and its JSON the
default of ``config_json``. The typed parameters come from
:data:`components.core.config.PIPELINE_PARAMETERS`. The same definition runs on one machine with
``kfp.local`` (``relaunch run``, :mod:`pipelines.local_run`). Retries come from
:data:`components.core.exitcodes.RETRY_POLICIES`; caching is off for every step (a cached "latest
checkpoint" is a wrong one, and prepare's outputs include this run's MLflow run).

KFP ships each component body as source and reads its outputs from the inline ``NamedTuple``
return annotation; tests/pipelines/test_kfp_pipeline.py compares those with the steps' output
dataclasses and prepare's parameters with the table.
"""

# no `from __future__ import annotations`: kfp reads the component annotations as real types
import inspect
import sys
from typing import NamedTuple

import yaml
from kfp import compiler, dsl

from components import EVALUATE, FINALIZE, LAUNCH, LOCATE, PREPARE, REGISTER
from components.core.config import (PIPELINE_PARAMETERS, RelaunchConfig, pipeline_parameter_description,
                                    pipeline_parameter_type)
from components.core.exitcodes import RETRY_POLICIES

# ---------------------------------------------------------------- component bodies (shipped as source)


def prepare(config_json: str, pipeline_run_id: str, epochs: int, max_steps: int, learning_rate: float,
            nodes: int, procs_per_node: int, inject_failure: str, resume_from: str, warm_start_model: str,
            run_name: str) -> NamedTuple("PrepareOutputs", [("config_json", str), ("run_id", str),
                                                            ("dataset_version", str), ("dataset_uri", str),
                                                            ("experiment_id", str)]):
    """Build or reuse the dataset, open the MLflow run, resolve the configuration."""
    arguments = dict(locals())  # config_json, pipeline_run_id and the pipeline parameters
    from pipelines.kfp_entry import call

    return call("prepare", **arguments)


def locate_latest_checkpoint(config_json: str) -> NamedTuple(
        "LocateOutputs", [("checkpoint_uri", str), ("step", int), ("source", str)]):
    """The checkpoint training starts from ("" when none)."""
    from pipelines.kfp_entry import call

    return call("locate-latest-checkpoint", config_json)


def launch(config_json: str, resume_from: str, pipeline_run_id: str) -> NamedTuple(
        "LaunchOutputs", [("restarts", int), ("resumed_from_steps", str),
                          ("train_seconds", float), ("duration_seconds", float), ("ettr", float),
                          ("last_checkpoint_uri", str), ("job_name", str)]):
    """Run the distributed training to its end (local torchrun agents or a PyTorchJob)."""
    from pipelines.kfp_entry import call

    return call("launch", config_json, resume_from=resume_from, pipeline_run_id=pipeline_run_id)


def evaluate(config_json: str) -> NamedTuple(
        "EvaluateOutputs", [("metrics_json", str), ("passed", bool), ("checkpoint_uri", str), ("step", int)]):
    """Metrics of the final checkpoint on the held-out split, and the gate's verdict."""
    from pipelines.kfp_entry import call

    return call("evaluate", config_json)


def register(config_json: str, checkpoint_uri: str, metrics_json: str) -> NamedTuple(
        "RegisterOutputs", [("model_name", str), ("version", str), ("aliases", str),
                            ("champion_version", str), ("champion_decision", str)]):
    """Register the model version, set challenger/champion, pin its checkpoint."""
    from pipelines.kfp_entry import call

    return call("register", config_json, checkpoint_uri=checkpoint_uri, metrics_json=metrics_json)


def finalize(config_json: str, pipeline_run_id: str, status: dsl.PipelineTaskFinalStatus) -> NamedTuple(
        "FinalizeOutputs", [("run_id", str), ("status", str)]):
    """Exit task: mark the MLflow run FINISHED, or FAILED with the reason."""
    from pipelines.kfp_entry import call

    return call("finalize", config_json, pipeline_run_id=pipeline_run_id, state=status.state,
                error=status.error_message or "")


COMPONENT_BODIES = {PREPARE.name: prepare, LOCATE.name: locate_latest_checkpoint, LAUNCH.name: launch,
                    EVALUATE.name: evaluate, REGISTER.name: register, FINALIZE.name: finalize}
"""Step name -> the function KFP turns into its component (KFP names the task after the function)."""

PIPELINE_DESCRIPTION = ("Fault-tolerant, resumable distributed PyTorch training: prepare, locate the latest "
                        "checkpoint, launch, evaluate, register.")
CONFIG_JSON_DESCRIPTION = ("The whole relaunch configuration as JSON (see the README's configuration reference); "
                           "the parameters below override single fields of it.")

# ---------------------------------------------------------------- the pipeline of one configuration


def build_components(image: str) -> dict:
    """Every step's lightweight component, running in ``image`` (the project image has kfp installed)."""
    return {name: dsl.component(body, base_image=image, install_kfp_package=False)
            for name, body in COMPONENT_BODIES.items()}


def _step(task: dsl.PipelineTask, step: str) -> dsl.PipelineTask:
    policy = RETRY_POLICIES[step]
    task.set_retry(num_retries=policy.limit, backoff_duration=f"{policy.backoff_seconds}s",
                   backoff_factor=float(policy.factor), backoff_max_duration=f"{policy.max_backoff_seconds}s")
    task.set_caching_options(False)
    return task


def _signature(config: RelaunchConfig) -> inspect.Signature:
    """``(config_json: str = <config>, epochs: int = 0, ..., run_name: str = "")``: 0 or "" keeps."""
    keyword = inspect.Parameter.POSITIONAL_OR_KEYWORD
    params = [inspect.Parameter("config_json", keyword, annotation=str, default=config.to_json())]
    for name in PIPELINE_PARAMETERS:
        kind = pipeline_parameter_type(name)
        params.append(inspect.Parameter(name, keyword, annotation=kind, default=kind()))
    return inspect.Signature(params)


def _docstring() -> str:
    args = "\n".join(f"    {name}: {pipeline_parameter_description(name)}" for name in PIPELINE_PARAMETERS)
    return ("Train, evaluate and register a model; a retried or re-run pipeline resumes from the latest "
            f"checkpoint.\n\nArgs:\n    config_json: {CONFIG_JSON_DESCRIPTION}\n{args}\n")


def build_pipeline(config: RelaunchConfig | None = None):
    """The KFP pipeline of ``config``: its image in every component, its JSON as ``config_json``'s default.

    Returns:
        the ``@dsl.pipeline`` object: compile it, or call it under ``kfp.local``.
    """
    config = config or RelaunchConfig()
    comp = build_components(config.launch.kubernetes.image)
    signature = _signature(config)

    def relaunch_pipeline(*args, **kwargs):
        values = signature.bind(*args, **kwargs).arguments
        config_json = values.pop("config_json")
        closing = comp[FINALIZE.name](config_json=config_json, pipeline_run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER)
        closing.set_caching_options(False)
        with dsl.ExitHandler(closing, name="relaunch-run"):
            prep = _step(comp[PREPARE.name](config_json=config_json, pipeline_run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER,
                                            **values), PREPARE.name)
            resolved = prep.outputs["config_json"]
            located = _step(comp[LOCATE.name](config_json=resolved), LOCATE.name)
            trained = _step(comp[LAUNCH.name](config_json=resolved, resume_from=located.outputs["checkpoint_uri"],
                                              pipeline_run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER), LAUNCH.name)
            evaluated = _step(comp[EVALUATE.name](config_json=resolved), EVALUATE.name).after(trained)
            with dsl.If(evaluated.outputs["passed"] == True, name="gate-passed"):  # noqa: E712 - a DSL expression
                _step(comp[REGISTER.name](config_json=resolved, checkpoint_uri=evaluated.outputs["checkpoint_uri"],
                                          metrics_json=evaluated.outputs["metrics_json"]), REGISTER.name)

    relaunch_pipeline.__signature__ = signature
    relaunch_pipeline.__doc__ = _docstring()
    return dsl.pipeline(name="relaunch", description=PIPELINE_DESCRIPTION)(relaunch_pipeline)


def compile_pipeline(path: str, config: RelaunchConfig | None = None) -> None:
    """Write the KFP v2 pipeline YAML of ``config`` (the defaults when None) to ``path``."""
    compiler.Compiler().compile(build_pipeline(config), path)


class _YamlDumper(yaml.SafeDumper):
    """Our own string style: the output must not depend on what else the process imported (hera
    swaps SafeDumper's global str representer)."""


_YamlDumper.add_representer(
    str, lambda dumper, text: dumper.represent_scalar("tag:yaml.org,2002:str", text, style="|" if "\n" in text else None))


def to_yaml(documents: list) -> str:
    """Stable YAML (sorted keys, multi-line strings as blocks) for compiled files and goldens."""
    return yaml.dump_all(documents, Dumper=_YamlDumper, sort_keys=True, width=1000)


if __name__ == "__main__":
    compile_pipeline(sys.argv[1] if len(sys.argv) > 1 else "pipeline.kfp.yaml")
