"""The relaunch pipeline as Argo Workflows v4 (Hera): a Workflow, a WorkflowTemplate (what a platform
team installs once) and a CronWorkflow of one DAG,

    prepare >> locate-latest-checkpoint >> launch >> evaluate >> register (when evaluate passed)

with an ``onExit`` handler that closes the MLflow run (FAILED unless the workflow succeeded) and
deletes the training job (PyTorchJob or TrainJob, per ``launch.backend``) when the workflow failed or
was stopped. The exit-handler steps are retried too: one transient API error must not orphan a job
that holds GPUs.

    relaunch compile --target argo|argo-template|argo-cron -o FILE      # or: python -m relaunch.pipelines.argo

A configuration with a ``tune:`` space compiles the study (:data:`relaunch.pipelines.spec.TUNE_PIPELINE`): the
trials are one ``withParam`` task over plan-trials' items, the DAG's ``parallelism`` is ``tune.parallel``, and
the trial template's ``retryStrategy`` retries each item's pod on its own.

Wiring only: :func:`_define` walks the pipeline spec (:data:`relaunch.pipelines.spec.PIPELINE`: steps, inputs,
conditions, retries, exit handler), as the KFP renderer does. Every step is ``python -m <its module>``
in the project image (its outputs are the files the step CLI writes); the retry expression is
:func:`~relaunch.components.core.contract.exitcodes.argo_retry_expression`; credentials are ``secretKeyRef`` env
entries (:func:`relaunch.components.launchers.jobs.secret_env`).
"""

from __future__ import annotations

import sys

import yaml
from hera.workflows import (DAG, Container, CronWorkflow, Parameter, RetryStrategy, SecretVolume, Workflow,
                            WorkflowTemplate)
from hera.workflows import models as m

from .spec import (CONFIG, FINAL_STATUS, PARAMETERS, PIPELINE, RUN_ID, Condition, Pipeline, Step,
                   item_field, pipeline_config, pipeline_of)
from ..components.core.contract.config import RelaunchConfig
from ..components.core.contract.exitcodes import argo_retry_expression
from ..components.launchers.jobs import OWNER_ENV, plain_env, secret_env, store_secret_files

OUTPUTS_DIR = "/tmp/outputs"
ARTIFACT_REPOSITORY = m.ArtifactRepositoryRef(config_map="artifact-repositories", key="minio")
# Argo's maxDuration counts from a step's first attempt, so it is (retries + 1) x one attempt's bound
# + the backoffs. One attempt of the step that creates the training job is bounded by
# launch.kubernetes.wait_timeout_seconds; of any other step by STEP_ATTEMPT_SECONDS (no other step
# comes near it); of an exit-handler step (one MLflow or Kubernetes API call) by EXIT_HANDLER_ATTEMPT_SECONDS.
STEP_ATTEMPT_SECONDS = 3600
EXIT_HANDLER_ATTEMPT_SECONDS = 600
WORKFLOW_OWNER = {"apiVersion": "argoproj.io/v1alpha1", "kind": "Workflow",
                  "name": "{{workflow.name}}", "uid": "{{workflow.uid}}"}
# What the pipeline's own sources are on Argo (relaunch.pipelines.spec.Source), and the exit handler's status.
PIPELINE_VALUES = {CONFIG: "{{workflow.parameters.config_json}}", RUN_ID: "{{workflow.uid}}"}
FINAL_STATUS_VALUES = {"state": "{{=workflow.status == 'Succeeded' ? 'SUCCEEDED' : 'FAILED'}}",
                       "error": "workflow {{workflow.name}} ended {{workflow.status}}"}
WORKFLOW_STATUS = "{{workflow.status}}"
EXIT_HANDLER = "exit-handler"


def pipeline_parameters(config: RelaunchConfig) -> list[Parameter]:
    """The workflow's parameters: the KFP pipeline's, same names, defaults and descriptions."""
    from .kfp_pipeline import build_pipeline

    params = []
    for name, spec in build_pipeline(config).component_spec.inputs.items():
        default = pipeline_config(config).to_json() if name == "config_json" else spec.default
        text = default if isinstance(default, str) else yaml.safe_dump(default).strip().removesuffix("...").strip()
        params.append(Parameter(name=name, value=text, description=f"({spec.type}) {spec.description or ''}".strip()))
    return params


def retry_strategy(step: Step, config: RelaunchConfig, pipeline: Pipeline = PIPELINE) -> RetryStrategy:
    """The step's retries; Argo's maxDuration counts from the first attempt's start, so it must
    outlast every attempt (a launch waits up to ``wait_timeout_seconds``, a trial launches its training up
    to ``tune.trial_retries`` more times) plus the backoffs. On a fanned-out step (``withParam``) Argo
    retries each item's pod on its own."""
    policy = step.retry
    backoffs = sum(min(policy.backoff_seconds * policy.factor**i, policy.max_backoff_seconds) for i in range(policy.limit))
    if step.creates_job:
        launches = config.tune.trial_retries + 1 if step.for_each else 1
        attempt = int(config.launch.kubernetes.wait_timeout_seconds) * launches
    else:
        attempt = EXIT_HANDLER_ATTEMPT_SECONDS if step in pipeline.exit_handler else STEP_ATTEMPT_SECONDS
    return RetryStrategy(
        limit=policy.limit,
        retry_policy="Always",  # the default (OnFailure) never retries Error; the expression decides
        expression=argo_retry_expression(),
        backoff=m.Backoff(duration=f"{policy.backoff_seconds}s", factor=policy.factor,
                          cap=f"{policy.max_backoff_seconds}s", max_duration=f"{(policy.limit + 1) * attempt + backoffs}s"),
        affinity=m.RetryAffinity(node_anti_affinity=m.RetryNodeAntiAffinity()),
    )


def _env(entries: list[dict]) -> list[m.EnvVar]:
    return [m.EnvVar.model_validate(e) for e in entries]


def arguments(step: Step, params: list[str]) -> dict[str, str]:
    """``step``'s inputs as Argo argument values, in order (``params``: the pipeline parameters)."""
    values: dict[str, str] = {}
    for item in step.inputs:
        source = item.source
        if source.step:
            values[item.name] = f"{{{{tasks.{source.step}.outputs.parameters.{source.output}}}}}"
        elif item_field(source):
            values[item.name] = f"{{{{item.{item_field(source)}}}}}"
        elif source == PARAMETERS:
            values.update({n: f"{{{{workflow.parameters.{n}}}}}" for n in params})
        elif source == FINAL_STATUS:
            values.update(FINAL_STATUS_VALUES)
        else:
            values[item.name] = PIPELINE_VALUES[source]
    return values


def condition(when: Condition) -> str:
    """``when`` as an Argo ``when`` expression."""
    source = when.source
    subject = WORKFLOW_STATUS if source == FINAL_STATUS else f"{{{{tasks.{source.step}.outputs.parameters.{source.output}}}}}"
    value = str(when.value).lower() if isinstance(when.value, bool) else when.value
    return f"{subject} {when.op} {value}"


def step_template(step: Step, config: RelaunchConfig, inputs: list[str], pipeline: Pipeline = PIPELINE) -> Container:
    """``python -m <module> --config-json ... --input name=... --outputs-dir /tmp/outputs``."""
    k8s = config.launch.kubernetes
    extra_env = {var: WORKFLOW_OWNER[field] for field, var in OWNER_ENV.items()} if step.creates_job else {}
    args = ["--config-json", "{{inputs.parameters.config_json}}"]
    for name in inputs:
        if name != "config_json":
            args += ["--input", f"{name}={{{{inputs.parameters.{name}}}}}"]
    return Container(
        name=step.name,
        image=k8s.image,
        image_pull_policy=k8s.image_pull_policy,
        command=["python", "-m", step.module],
        args=args + ["--outputs-dir", OUTPUTS_DIR],
        inputs=[Parameter(name=n) for n in inputs],
        outputs=[Parameter(name=o, value_from=m.ValueFrom(path=f"{OUTPUTS_DIR}/{o}")) for o, _ in step.output_fields()],
        env=_env(plain_env(k8s) + [{"name": k, "value": v} for k, v in extra_env.items()]
                 + secret_env(k8s, config.store.uri)),
        volumes=[SecretVolume(name=f"secret-{f.secret}"[:63].rstrip("-"), secret_name=f.secret, mount_path=f.mount_dir,
                              read_only=True, default_mode=0o400, items=[m.KeyToPath(key=f.key, path=f.key)])
                 for f in store_secret_files(k8s, config.store.uri)] or None,
        retry_strategy=retry_strategy(step, config, pipeline),
    )


def _define(config: RelaunchConfig) -> None:
    """Inside a ``with Workflow(...)``: the templates and the two DAGs (main and exit handler), walked
    from the pipeline of ``config`` (:func:`relaunch.pipelines.spec.pipeline_of`: the training, or a study's)."""
    pipeline = pipeline_of(config)
    params = [p.name for p in pipeline_parameters(config) if p.name != "config_json"]
    templates = {s.name: step_template(s, config, list(arguments(s, params)), pipeline) for s in pipeline.all_steps()}
    for dag_name, steps in ((pipeline.name, pipeline.steps), (EXIT_HANDLER, pipeline.exit_handler)):
        # a study's trials run tune.parallel at once (the DAG's other steps run one at a time anyway)
        limit = {"parallelism": config.tune.parallel} if dag_name == pipeline.name and pipeline is not PIPELINE else {}
        with DAG(name=dag_name, **limit):
            tasks = {}
            for step in steps:
                extra = {"when": condition(step.when)} if step.when else {}
                if step.for_each:  # one pod per item, each retried on its own by the template's retryStrategy
                    extra["with_param"] = f"{{{{tasks.{step.for_each.step}.outputs.parameters.{step.for_each.output}}}}}"
                tasks[step.name] = templates[step.name](arguments=arguments(step, params), **extra)
                for name in pipeline.dependencies(step):
                    tasks[name] >> tasks[step.name]


def _spec(config: RelaunchConfig) -> dict:
    k8s = config.launch.kubernetes
    return dict(
        namespace=k8s.namespace,
        entrypoint=pipeline_of(config).name,
        on_exit=EXIT_HANDLER,
        service_account_name=k8s.service_account,
        artifact_repository_ref=ARTIFACT_REPOSITORY,
        arguments=pipeline_parameters(config),
        labels={"app.kubernetes.io/name": "relaunch", "app.kubernetes.io/part-of": config.name},
    )


def build_workflow(config: RelaunchConfig | None = None) -> Workflow:
    """One run of the pipeline (``generateName: <name>-``)."""
    config = config or RelaunchConfig()
    with Workflow(generate_name=f"{config.name}-", **_spec(config)) as w:
        _define(config)
    return w


def build_workflow_template(config: RelaunchConfig | None = None) -> WorkflowTemplate:
    """The pipeline installed once; runs are submitted from it with ``workflowTemplateRef``."""
    config = config or RelaunchConfig()
    with WorkflowTemplate(name=config.name, **_spec(config)) as w:
        _define(config)
    return w


def build_cron_workflow(config: RelaunchConfig | None = None, *, cron: str = "0 3 * * *",
                        starting_deadline_seconds: int = 600, timezone: str = "UTC") -> CronWorkflow:
    """A recurring run: one at a time (``Forbid``), a missed start skipped after the deadline."""
    config = config or RelaunchConfig()
    with CronWorkflow(name=f"{config.name}-cron", schedules=[cron], timezone=timezone,
                      concurrency_policy="Forbid", starting_deadline_seconds=starting_deadline_seconds,
                      successful_jobs_history_limit=3, failed_jobs_history_limit=3, **_spec(config)) as w:
        _define(config)
    return w


BUILDERS = {"argo": build_workflow, "argo-template": build_workflow_template, "argo-cron": build_cron_workflow}


def to_dict(workflow) -> dict:
    """The manifest as plain data (Hera drops unset fields)."""
    return workflow.to_dict()


def to_yaml(workflow) -> str:
    """Stable YAML (sorted keys) for files, goldens and ``kubectl apply``."""
    return yaml.safe_dump(to_dict(workflow), sort_keys=True, width=1000)


if __name__ == "__main__":
    target = sys.argv[1] if len(sys.argv) > 1 else "argo"
    sys.stdout.write(to_yaml(BUILDERS[target]()))
