"""The pipeline, written once: its steps (one module each), which output feeds which input, the
evaluation gate, the retries and the exit handler. :data:`PIPELINE` is walked by both renderers,
:mod:`relaunch.pipelines.kfp_pipeline` (KFP v2, and ``relaunch run`` through ``kfp.local``) and
:mod:`relaunch.pipelines.argo` (Argo Workflows); the local run, the console and the tests read each step's
module and outputs from here, its name from :mod:`relaunch.components.core.contract.steps`.

    prepare >> locate-latest-checkpoint >> launch >> evaluate >> register (when evaluate passed: the
    training completed, launch says, and its metric met the gate)
    on exit, whatever happened: finalize; delete-training-job (Argo, when the workflow did not succeed)

A configuration with a ``tune:`` space compiles :data:`TUNE_PIPELINE` instead (:func:`pipeline_of`), a study:

    prepare (the study's folder) >> plan-trials >> run-trial, once per trial (tune.parallel at once) >>
    select-best-trial >> evaluate (the best trial) >> register (when evaluate passed)
    on exit, whatever happened: finalize (the study's MLflow run)
"""

from __future__ import annotations

import dataclasses
import importlib
import re
import typing
from dataclasses import dataclass

from ..components.core.contract import steps as names
from ..components.core.contract.errors import BadInput
from ..components.core.contract.exitcodes import RetryPolicy


@dataclass(frozen=True)
class Source:
    """Where an input's value comes from: output ``output`` of step ``step``, or (``step == ""``) the
    pipeline itself (:data:`CONFIG`, :data:`RUN_ID`, :data:`PARAMETERS`, :data:`FINAL_STATUS`)."""

    step: str
    output: str


CONFIG = Source("", "config_json")
"""The pipeline's ``config_json`` parameter (the configuration as submitted)."""
RUN_ID = Source("", "run_id")
"""The pipeline run's id (KFP's job id, Argo's ``workflow.uid``)."""
PARAMETERS = Source("", "parameters")
"""Every typed pipeline parameter (:data:`relaunch.components.core.contract.pipeline_parameters.PIPELINE_PARAMETERS`), each under its own name."""
ITEM_PREFIX = "item."


def item(field: str) -> Source:
    """Field ``field`` of the item of a fanned-out step's list (:attr:`Step.for_each`, a list of objects):
    KFP's ``ParallelFor`` loop item's field, Argo's ``{{item.<field>}}``."""
    return Source("", f"{ITEM_PREFIX}{field}")


def item_field(source: Source) -> str | None:
    """The field of the loop item that ``source`` is (:func:`item`), else None."""
    return source.output.removeprefix(ITEM_PREFIX) if not source.step and source.output.startswith(ITEM_PREFIX) else None

FINAL_STATUS = Source("", "status")
"""How the pipeline ended (exit handler only): KFP's ``PipelineTaskFinalStatus``, on Argo the
``state`` and ``error`` that ``workflow.status`` gives."""


@dataclass(frozen=True)
class Input:
    """One input of a step: its name in the step's ``run`` and where its value comes from."""

    name: str
    source: Source


@dataclass(frozen=True)
class Condition:
    """Run the step only when ``source <op> value`` (``op`` is ``==`` or ``!=``)."""

    name: str
    """The condition's name (KFP's ``dsl.If`` group)."""
    source: Source
    op: str
    value: bool | str


@dataclass(frozen=True)
class Step:
    """One task of the pipeline."""

    name: str
    """Kebab-case task name, the same in KFP and Argo."""
    module: str
    """The module whose ``run(config, **inputs)`` the task calls (``python -m <module>`` on Argo)."""
    outputs: str
    """The dataclass ``run`` returns, defined in ``module``: the task's outputs, in order."""
    inputs: tuple[Input, ...] = ()
    """``run``'s inputs, in order (``config_json`` first: every step reads a configuration)."""
    after: tuple[str, ...] = ()
    """Steps that must end first although no output of theirs is an input."""
    when: Condition | None = None
    retry: RetryPolicy | None = None
    """How the task is retried (on a retryable exit code only); None: never."""
    uses_torch: bool = False
    """The step, or a process it starts, imports torch (``relaunch run`` forks it from the warm server
    that loaded torch; the others from the one that did not, which is ready seconds sooner)."""
    creates_job: bool = False
    """The step creates the training job (Argo names the workflow as the job's owner)."""
    on_kfp: bool = True
    """Rendered in the KFP pipeline too (KFP's ``ExitHandler`` takes one exit task)."""
    for_each: Source | None = None
    """Run the step once per item of this output (a JSON list of objects; :func:`item` reads their fields),
    ``tune.parallel`` at once: KFP's ``ParallelFor``, Argo's ``withParam``. A later step that waits for it
    waits for every item."""

    def outputs_class(self) -> type:
        return getattr(importlib.import_module(self.module), self.outputs)

    def output_fields(self) -> list[tuple[str, type]]:
        """``[(name, type), ...]`` of the outputs, in order (what KFP's return annotation must say)."""
        hints = typing.get_type_hints(self.outputs_class())
        return [(f.name, hints[f.name]) for f in dataclasses.fields(self.outputs_class())]

    def upstream(self) -> tuple[str, ...]:
        """The steps this one waits for: those whose outputs it reads, then :attr:`after`, in order."""
        names = ([self.for_each.step] if self.for_each else []) + [i.source.step for i in self.inputs if i.source.step] \
            + list(self.after)
        return tuple(dict.fromkeys(names))


def output(step: Step, name: str) -> Source:
    """Output ``name`` of ``step`` as a source."""
    return Source(step.name, name)


@dataclass(frozen=True)
class Pipeline:
    """The DAG and its exit handler; renderers walk :attr:`steps`, then :attr:`exit_handler`."""

    name: str
    steps: tuple[Step, ...]
    """The DAG, each step after the steps it reads from."""
    exit_handler: tuple[Step, ...]
    """Run once the DAG ended, whatever it did."""

    def all_steps(self) -> tuple[Step, ...]:
        return self.steps + self.exit_handler

    def step(self, name: str) -> Step:
        return next(s for s in self.all_steps() if s.name == name)

    def dependencies(self, step: Step) -> tuple[str, ...]:
        """:meth:`Step.upstream` without the steps another upstream step already waits for (Argo's
        ``depends``; KFP lists every upstream task)."""
        upstream = step.upstream()

        def reaches(name: str, target: str) -> bool:
            return any(u == target or reaches(u, target) for u in self.step(name).upstream())

        return tuple(u for u in upstream if not any(reaches(other, u) for other in upstream if other != u))


DEFAULT_RETRY = RetryPolicy(limit=3, backoff_seconds=5, factor=2, max_backoff_seconds=60)
EXIT_HANDLER_RETRY = RetryPolicy(limit=5, backoff_seconds=5, factor=2, max_backoff_seconds=60)
"""Exit-handler steps are quick API calls, retried often so that a transient error never orphans a job
(on Argo; the KFP exit task has never been retried, and retrying it there is a change of its own)."""

PREPARE = Step(names.PREPARE, "relaunch.components.prepare", "PrepareOutputs",
               inputs=(Input("config_json", CONFIG), Input("pipeline_run_id", RUN_ID), Input("parameters", PARAMETERS)),
               retry=DEFAULT_RETRY)
RESOLVED = Input("config_json", output(PREPARE, "config_json"))
"""What every later step of the DAG reads: the configuration prepare resolved."""
LOCATE = Step(names.LOCATE, "relaunch.components.locate", "LocateOutputs", inputs=(RESOLVED,), retry=DEFAULT_RETRY)
LAUNCH = Step(names.LAUNCH, "relaunch.components.launch", "LaunchOutputs",
              inputs=(RESOLVED, Input("resume_from", output(LOCATE, "checkpoint_uri")), Input("pipeline_run_id", RUN_ID)),
              # training restarts inside torchrun / the job first; a whole launch retry is the outer loop
              retry=RetryPolicy(limit=4, backoff_seconds=10, factor=2, max_backoff_seconds=300),
              uses_torch=True, creates_job=True)
EVALUATE = Step(names.EVALUATE, "relaunch.components.evaluate", "EvaluateOutputs",
                # the registry gate: a training that did not reach its end is neither evaluated nor registered
                inputs=(RESOLVED, Input("training_completed", output(LAUNCH, "completed"))),
                retry=RetryPolicy(limit=2, backoff_seconds=5, factor=2, max_backoff_seconds=60), uses_torch=True)
REGISTER = Step(names.REGISTER, "relaunch.components.register", "RegisterOutputs",
                inputs=(RESOLVED, Input("checkpoint_uri", output(EVALUATE, "checkpoint_uri")),
                        Input("metrics_json", output(EVALUATE, "metrics_json"))),
                when=Condition("gate-passed", output(EVALUATE, "passed"), "==", True), retry=DEFAULT_RETRY)
FINALIZE = Step(names.FINALIZE, "relaunch.components.finalize", "FinalizeOutputs",
                inputs=(Input("config_json", CONFIG), Input("pipeline_run_id", RUN_ID), Input("status", FINAL_STATUS)),
                retry=EXIT_HANDLER_RETRY)
"""Close the MLflow run: FINISHED, or FAILED with the reason."""
DELETE_JOB = Step(names.DELETE_JOB, "relaunch.components.launchers.cluster", "DeleteOutputs",
                  inputs=(Input("config_json", CONFIG), Input("pipeline_run_id", RUN_ID)),
                  when=Condition("pipeline-failed", FINAL_STATUS, "!=", "Succeeded"), retry=EXIT_HANDLER_RETRY,
                  on_kfp=False)
"""Delete the run's training job when the pipeline failed or was stopped."""

PIPELINE = Pipeline(name="relaunch", steps=(PREPARE, LOCATE, LAUNCH, EVALUATE, REGISTER),
                    exit_handler=(FINALIZE, DELETE_JOB))


TRIAL_RETRY = RetryPolicy(limit=3, backoff_seconds=10, factor=2, max_backoff_seconds=300)
"""Argo's retries of a run-trial step whose own pod died; the trial's training is relaunched inside the step
(``tune.trial_retries``), the retry KFP honours inside a ``ParallelFor``."""
STUDY_CONFIG = Input("config_json", output(PREPARE, "config_json"))
"""What the tuning steps read: the study's configuration prepare resolved (its ``store.uri`` the study folder)."""
STUDY_RUN = Input("parent_run_id", output(PREPARE, "run_id"))
"""The study's MLflow run, the parent of each trial's."""
PLAN_TRIALS = Step(names.PLAN_TRIALS, "relaunch.components.plan_trials", "PlanOutputs", inputs=(STUDY_CONFIG, STUDY_RUN),
                   retry=DEFAULT_RETRY)
# The trial reads the study's configuration and run from its item, not from prepare: kfp.local 2.17 hands a
# ParallelFor body the loop item in place of every task output from outside the loop (the compiled pipeline
# is the same either way, and a cluster's KFP and Argo pass the item's fields as they pass any parameter).
RUN_TRIAL = Step(names.RUN_TRIAL, "relaunch.components.run_trial", "TrialOutputs",
                 inputs=(Input("config_json", item("config_json")), Input("trial", item("trial")),
                         Input("parent_run_id", item("parent_run_id")), Input("pipeline_run_id", RUN_ID)),
                 for_each=output(PLAN_TRIALS, "trials"), retry=TRIAL_RETRY, uses_torch=True, creates_job=True)
SELECT_TRIAL = Step(names.SELECT_TRIAL, "relaunch.components.select_best_trial", "SelectOutputs",
                    inputs=(STUDY_CONFIG, STUDY_RUN), after=(RUN_TRIAL.name,), retry=DEFAULT_RETRY)
BEST = Input("config_json", output(SELECT_TRIAL, "config_json"))
"""The best trial's configuration: its folder, checkpoints and MLflow run."""
EVALUATE_BEST = dataclasses.replace(EVALUATE, inputs=(BEST, Input("training_completed", output(SELECT_TRIAL, "found"))))
REGISTER_BEST = dataclasses.replace(REGISTER, inputs=(BEST, *REGISTER.inputs[1:]))
TUNE_PIPELINE = Pipeline(name="relaunch-tune", steps=(PREPARE, PLAN_TRIALS, RUN_TRIAL, SELECT_TRIAL, EVALUATE_BEST,
                                                      REGISTER_BEST),
                         exit_handler=(FINALIZE, DELETE_JOB))
"""The tuning pipeline: a study of trainings, the best one evaluated and registered. Its trials' jobs are
named after the run and the trial and labelled with the run; on Argo the workflow owns them (deleted with
it), and a study that failed or was stopped deletes them in its exit handler (they would train on)."""


def pipeline_of(config) -> Pipeline:
    """:data:`TUNE_PIPELINE` for a configuration with a ``tune:`` space, else :data:`PIPELINE`."""
    return TUNE_PIPELINE if config.tune.space else PIPELINE


def pipeline_config(config):
    """The configuration the pipeline of ``config`` carries: ``config`` itself, or for a study a copy whose
    ``store.uri`` is the study's folder (``<store>/studies/<study>``, where prepare puts the dataset and the
    study's MLflow run, and the trials their folders) and whose ``tune.study`` is fixed.

    Raises:
        BadInput: ``tune.storage`` holds a password (it would be written into the compiled pipeline).
    """
    # the store's modules load pydantic, which the spec's other readers (the KFP entry, the console) load later or never
    from ..components.core.store import parse_store_uri
    from ..components.core.tuning.study_folder import study_uri

    if not config.tune.space:
        return config
    if config.tune.storage and re.search(r"://[^/@:]*:[^/@]+@", config.tune.storage):
        raise BadInput("tune.storage holds a password, which the compiled pipeline would carry; drop it from the URL "
                       "and give the steps PGPASSWORD from a Secret")
    if not config.tune.storage and parse_store_uri(config.store.uri)[0] != "file":
        raise BadInput(f"tune.storage is unset and store.uri {config.store.uri!r} is not a local folder: a study's trials "
                       "run in pods of their own and share its Optuna storage in a database; set tune.storage to a "
                       "PostgreSQL URL (e.g. postgresql://mlflow@postgres.relaunch.svc/optuna)")
    study = config.model_copy(deep=True)
    study.tune.study = config.study_name
    study.store.uri = study_uri(config.store.uri, config.study_name)
    return study


STEP_TABLE: dict[str, Step] = {s.name: s for s in PIPELINE.all_steps() if s.on_kfp}
"""Every task the KFP pipeline (and so ``relaunch run``) runs, by name, in pipeline order, the exit task last."""
STEPS: tuple[str, ...] = tuple(s.name for s in PIPELINE.steps)
"""The five retried steps of the DAG, in order."""
KFP_STEPS: dict[str, Step] = {s.name: s for p in (PIPELINE, TUNE_PIPELINE) for s in p.all_steps() if s.on_kfp}
"""Every step the KFP entry may call, of either pipeline, by name."""
STEP_MODULES: dict[str, str] = {name: s.module for name, s in KFP_STEPS.items()}
RETRY_POLICIES: dict[str, RetryPolicy] = {s.name: s.retry for s in PIPELINE.steps if s.retry}
"""Retries of each step of :data:`STEPS`."""
