"""The relaunch pipeline (:data:`relaunch.pipelines.spec.PIPELINE`) rendered as Kubeflow Pipelines v2: prepare ->
locate-latest-checkpoint -> launch -> evaluate -> register (only when evaluate's gate passed), inside
an exit handler whose ``finalize`` task closes the MLflow run (FAILED when the pipeline failed).
Wiring only: :func:`build_pipeline` walks the spec; each component body imports
:func:`relaunch.pipelines.kfp_entry.call`, which runs the step's ``run``.

    python -m relaunch.pipelines.kfp_pipeline build/pipeline.kfp.yaml     # or: relaunch compile --target kfp

A configuration with a ``tune:`` space compiles the study instead (:data:`relaunch.pipelines.spec.TUNE_PIPELINE`):
prepare, plan-trials, run-trial in a ``ParallelFor`` over plan-trials' items (``tune.parallel`` at once),
select-best-trial, evaluate and register of the best trial, finalize. KFP drops ``set_retry`` on a task
inside a ``ParallelFor`` (kubeflow/pipelines#12389), so the trial step relaunches its training itself.

:func:`build_pipeline` makes the components and the pipeline for one configuration: its image is
each component's ``base_image`` (KFP's own setting, nothing rewritten afterwards) and its JSON the
default of ``config_json``. The typed parameters come from
:data:`relaunch.components.core.contract.pipeline_parameters.PIPELINE_PARAMETERS`. The same definition runs on one machine with
``kfp.local`` (``relaunch run``, :mod:`relaunch.pipelines.local.runner`). Retries come from each step of the
spec; caching is off for every step (a cached "latest checkpoint" is a wrong one, and prepare's
outputs include this run's MLflow run).

KFP ships each component body as source (the executor in the container runs that text), so a body's
name, parameters and inline ``NamedTuple`` return annotation must be literals: they cannot be made
from the spec. tests/pipelines/test_kfp_pipeline.py checks each against the spec: the name is the
step's, the parameters are its inputs, the annotation is its output dataclass, field by field.
"""

# no `from __future__ import annotations`: kfp reads the component annotations as real types
import contextlib
import inspect
import operator
import sys
from typing import List, NamedTuple

import yaml
from kfp import compiler, dsl

from .spec import (CONFIG, EVALUATE, FINALIZE, LAUNCH, LOCATE, PARAMETERS, PIPELINE, PLAN_TRIALS,
                   PREPARE, REGISTER, RUN_ID, RUN_TRIAL, SELECT_TRIAL, Condition, Pipeline, Source, Step,
                   item_field, pipeline_config, pipeline_of)
from ..components.core.contract.config import RelaunchConfig
from ..components.core.contract.pipeline_parameters import (PIPELINE_PARAMETERS, pipeline_parameter_description,
                                                            pipeline_parameter_type)

# ---------------------------------------------------------------- component bodies (shipped as source)


def prepare(config_json: str, pipeline_run_id: str, epochs: int, max_steps: int, learning_rate: float,
            nodes: int, procs_per_node: int, inject_failure: str, resume_from: str, warm_start_model: str,
            run_name: str) -> NamedTuple("PrepareOutputs", [("config_json", str), ("run_id", str),
                                                            ("dataset_version", str), ("dataset_uri", str),
                                                            ("experiment_id", str)]):
    """Build or reuse the dataset, open the MLflow run, resolve the configuration."""
    arguments = dict(locals())  # config_json, pipeline_run_id and the pipeline parameters
    from relaunch.pipelines.kfp_entry import call

    return call("prepare", **arguments)


def locate_latest_checkpoint(config_json: str) -> NamedTuple(
        "LocateOutputs", [("checkpoint_uri", str), ("step", int), ("source", str)]):
    """The checkpoint training starts from ("" when none)."""
    from relaunch.pipelines.kfp_entry import call

    return call("locate-latest-checkpoint", config_json)


def launch(config_json: str, resume_from: str, pipeline_run_id: str) -> NamedTuple(
        "LaunchOutputs", [("restarts", int), ("resumed_from_steps", str),
                          ("train_seconds", float), ("duration_seconds", float), ("ettr", float),
                          ("last_checkpoint_uri", str), ("job_name", str), ("completed", bool)]):
    """Run the distributed training to its end (local torchrun agents or a PyTorchJob)."""
    from relaunch.pipelines.kfp_entry import call

    return call("launch", config_json, resume_from=resume_from, pipeline_run_id=pipeline_run_id)


def evaluate(config_json: str, training_completed: bool) -> NamedTuple(
        "EvaluateOutputs", [("metrics_json", str), ("passed", bool), ("checkpoint_uri", str), ("step", int)]):
    """Metrics of the final checkpoint on the held-out split, and the gate's verdict."""
    from relaunch.pipelines.kfp_entry import call

    return call("evaluate", config_json, training_completed=training_completed)


def register(config_json: str, checkpoint_uri: str, metrics_json: str) -> NamedTuple(
        "RegisterOutputs", [("model_name", str), ("version", str), ("aliases", str),
                            ("champion_version", str), ("champion_decision", str)]):
    """Register the model version, set challenger/champion, pin its checkpoint."""
    from relaunch.pipelines.kfp_entry import call

    return call("register", config_json, checkpoint_uri=checkpoint_uri, metrics_json=metrics_json)


def finalize(config_json: str, pipeline_run_id: str, status: dsl.PipelineTaskFinalStatus) -> NamedTuple(
        "FinalizeOutputs", [("run_id", str), ("status", str)]):
    """Exit task: mark the MLflow run FINISHED, or FAILED with the reason."""
    from relaunch.pipelines.kfp_entry import call

    return call("finalize", config_json, pipeline_run_id=pipeline_run_id, state=status.state,
                error=status.error_message or "")


def plan_trials(config_json: str, parent_run_id: str) -> List[dict]:
    """Open the study; the trials to run (those that have not ended): the fan-out's items."""
    from relaunch.pipelines.kfp_entry import call

    return call("plan-trials", config_json, parent_run_id=parent_run_id)[0]


def run_trial(config_json: str, trial: int, parent_run_id: str, pipeline_run_id: str) -> NamedTuple(
        "TrialOutputs", [("number", int), ("state", str), ("value", str), ("run_id", str), ("retries", int)]):
    """One trial: a relaunch training in its own folder, relaunched (resuming) on a retryable end."""
    from relaunch.pipelines.kfp_entry import call

    return call("run-trial", config_json, trial=trial, parent_run_id=parent_run_id, pipeline_run_id=pipeline_run_id)


def select_best_trial(config_json: str, parent_run_id: str) -> NamedTuple(
        "SelectOutputs", [("config_json", str), ("trial", int), ("value", float), ("run_id", str), ("found", bool)]):
    """The study's best trial, logged to the study's run; its configuration for evaluate and register."""
    from relaunch.pipelines.kfp_entry import call

    return call("select-best-trial", config_json, parent_run_id=parent_run_id)


COMPONENT_BODIES = {PREPARE.name: prepare, LOCATE.name: locate_latest_checkpoint, LAUNCH.name: launch,
                    EVALUATE.name: evaluate, REGISTER.name: register, FINALIZE.name: finalize,
                    PLAN_TRIALS.name: plan_trials, RUN_TRIAL.name: run_trial, SELECT_TRIAL.name: select_best_trial}
"""Step name -> the function KFP turns into its component (KFP names the task after the function)."""

SINGLE_OUTPUT = {PLAN_TRIALS.name}
"""Steps whose component returns its one output bare (KFP's ``Output``): what kfp.local can fan out over."""

PIPELINE_DESCRIPTION = ("Fault-tolerant, resumable distributed PyTorch training: prepare, locate the latest "
                        "checkpoint, launch, evaluate, register.")
TUNE_DESCRIPTION = ("A study of fault-tolerant trainings: prepare once, the trials fanned out (each resumes from its "
                    "own checkpoints when retried), the best trial evaluated and registered.")
CONFIG_JSON_DESCRIPTION = ("The whole relaunch configuration as JSON (see the README's configuration reference); "
                           "the parameters below override single fields of it.")

# ---------------------------------------------------------------- the pipeline of one configuration


def build_components(image: str) -> dict:
    """Every step's lightweight component, running in ``image`` (the project image has kfp installed)."""
    return {name: dsl.component(body, base_image=image, install_kfp_package=False)
            for name, body in COMPONENT_BODIES.items()}


def _retry(task: dsl.PipelineTask, step: Step) -> None:
    policy = step.retry
    task.set_retry(num_retries=policy.limit, backoff_duration=f"{policy.backoff_seconds}s",
                   backoff_factor=float(policy.factor), backoff_max_duration=f"{policy.max_backoff_seconds}s")


def _output(tasks: dict, source: Source):
    task = tasks[source.step]
    return task.output if source.step in SINGLE_OUTPUT else task.outputs[source.output]


def _arguments(step: Step, values: dict, tasks: dict, loop_item=None) -> dict:
    """``step``'s inputs as KFP arguments: pipeline values, outputs of tasks already made, the loop's item."""
    arguments = {}
    for item in step.inputs:
        source = item.source
        if source.step:
            arguments[item.name] = _output(tasks, source)
        elif item_field(source):
            arguments[item.name] = getattr(loop_item, item_field(source))
        elif source == PARAMETERS:
            arguments.update({name: value for name, value in values.items() if name in PIPELINE_PARAMETERS})
        elif source == RUN_ID:
            arguments[item.name] = dsl.PIPELINE_JOB_ID_PLACEHOLDER
        elif source == CONFIG:
            arguments[item.name] = values["config_json"]
        # FINAL_STATUS: KFP passes the dsl.PipelineTaskFinalStatus itself
    return arguments


def _condition(condition: Condition, tasks: dict):
    value = tasks[condition.source.step].outputs[condition.source.output]
    compare = {"==": operator.eq, "!=": operator.ne}[condition.op]
    return dsl.If(compare(value, condition.value), name=condition.name)


def _signature(config: RelaunchConfig) -> inspect.Signature:
    """``(config_json: str = <config>, epochs: int = 0, ..., run_name: str = "")``: 0 or "" keeps."""
    keyword = inspect.Parameter.POSITIONAL_OR_KEYWORD
    params = [inspect.Parameter("config_json", keyword, annotation=str, default=config.to_json())]
    for name in PIPELINE_PARAMETERS:
        kind = pipeline_parameter_type(name)
        params.append(inspect.Parameter(name, keyword, annotation=kind, default=kind()))
    return inspect.Signature(params)


def _docstring(pipeline: Pipeline) -> str:
    args = "\n".join(f"    {name}: {pipeline_parameter_description(name)}" for name in PIPELINE_PARAMETERS)
    what = ("Train, evaluate and register a model; a retried or re-run pipeline resumes from the latest checkpoint."
            if pipeline is PIPELINE else
            "Run a study of trainings, then evaluate and register its best trial; a retried trial resumes from its "
            "own checkpoints and a re-run pipeline does not run an ended trial again.")
    return f"{what}\n\nArgs:\n    config_json: {CONFIG_JSON_DESCRIPTION}\n{args}\n"


def build_pipeline(config: RelaunchConfig | None = None):
    """The KFP pipeline of ``config``: its image in every component, its JSON as ``config_json``'s default.

    Returns:
        the ``@dsl.pipeline`` object: compile it, or call it under ``kfp.local``.
    """
    config = config or RelaunchConfig()
    pipeline = pipeline_of(config)  # a configuration with a tune: space compiles the study
    config = pipeline_config(config)
    comp = build_components(config.launch.kubernetes.image)
    signature = _signature(config)

    def relaunch_pipeline(*args, **kwargs):
        values = signature.bind(*args, **kwargs).arguments
        tasks: dict[str, dsl.PipelineTask] = {}
        exit_task, = (s for s in pipeline.exit_handler if s.on_kfp)  # KFP's ExitHandler takes one task
        # the exit task is not retried on KFP (it never was; Argo retries its exit handler)
        closing = comp[exit_task.name](**_arguments(exit_task, values, tasks))
        closing.set_caching_options(False)
        with dsl.ExitHandler(closing, name=f"{pipeline.name}-run"):
            for step in pipeline.steps:
                with contextlib.ExitStack() as groups:
                    if step.when:
                        groups.enter_context(_condition(step.when, tasks))
                    item = None
                    if step.for_each:
                        # KFP drops set_retry inside a ParallelFor (kubeflow/pipelines#12389): the step retries
                        # its trial itself (components/run_trial.py); the policy stays for a backend that honours it
                        item = groups.enter_context(dsl.ParallelFor(_output(tasks, step.for_each),
                                                                    parallelism=config.tune.parallel))
                    task = comp[step.name](**_arguments(step, values, tasks, item))
                    _retry(task, step)
                    task.set_caching_options(False)
                    for name in step.after:
                        task.after(tasks[name])
                tasks[step.name] = task

    relaunch_pipeline.__signature__ = signature
    relaunch_pipeline.__doc__ = _docstring(pipeline)
    description = PIPELINE_DESCRIPTION if pipeline is PIPELINE else TUNE_DESCRIPTION
    return dsl.pipeline(name=pipeline.name, description=description)(relaunch_pipeline)


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
