"""The relaunch pipeline as Argo Workflows v4 (Hera): a Workflow, a WorkflowTemplate (what a platform
team installs once) and a CronWorkflow of one DAG,

    prepare >> locate-latest-checkpoint >> launch >> evaluate >> register (when evaluate passed)

with an ``onExit`` handler that closes the MLflow run (FAILED unless the workflow succeeded) and
deletes the training job (PyTorchJob or TrainJob, per ``launch.backend``) when the workflow failed or
was stopped. The exit-handler steps are retried too: one transient API error must not orphan a job
that holds GPUs.

    relaunch compile --target argo|argo-template|argo-cron -o FILE      # or: python -m pipelines.argo

Wiring only: every step is ``python -m components.<step>`` in the project image (its outputs are the
files the step CLI writes); retries come from :data:`components.core.exitcodes.RETRY_POLICIES` and
the expression from :func:`~components.core.exitcodes.argo_retry_expression`; credentials are
``secretKeyRef`` env entries (:func:`components.launchers.jobs.secret_env`).
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
import typing

import yaml
from hera.workflows import DAG, Container, CronWorkflow, Parameter, RetryStrategy, Workflow, WorkflowTemplate
from hera.workflows import models as m

from components import FINALIZE, STEP_MODULES
from components.core.config import RelaunchConfig
from components.core.exitcodes import RETRY_POLICIES, RetryPolicy, argo_retry_expression
from components.launchers.jobs import OWNER_ENV, plain_env, secret_env

OUTPUTS_DIR = "/tmp/outputs"
ARTIFACT_REPOSITORY = m.ArtifactRepositoryRef(config_map="artifact-repositories", key="minio")
DELETE_JOB = "delete-training-job"
MODULES = {**STEP_MODULES, DELETE_JOB: "components.launchers.cluster"}  # the same step names as KFP
# The exit handler's steps: quick API calls retried often, so a transient error never orphans a job.
EXIT_HANDLER_RETRY = RetryPolicy(limit=5, backoff_seconds=5, factor=2, max_backoff_seconds=60)
# Argo's maxDuration counts from a step's first attempt, so it is (retries + 1) x one attempt's bound
# + the backoffs. One attempt of launch is bounded by launch.kubernetes.wait_timeout_seconds; of any
# other step by STEP_ATTEMPT_SECONDS (no step but launch comes near it); of an exit-handler step (one
# MLflow or Kubernetes API call) by EXIT_HANDLER_ATTEMPT_SECONDS.
STEP_ATTEMPT_SECONDS = 3600
EXIT_HANDLER_ATTEMPT_SECONDS = 600
EXIT_HANDLER_STEPS = (FINALIZE.name, DELETE_JOB)
WORKFLOW_OWNER = {"apiVersion": "argoproj.io/v1alpha1", "kind": "Workflow",
                  "name": "{{workflow.name}}", "uid": "{{workflow.uid}}"}


def pipeline_parameters(config: RelaunchConfig) -> list[Parameter]:
    """The workflow's parameters: the KFP pipeline's, same names, defaults and descriptions."""
    from pipelines.kfp_pipeline import build_pipeline

    params = []
    for name, spec in build_pipeline(config).component_spec.inputs.items():
        default = config.to_json() if name == "config_json" else spec.default
        text = default if isinstance(default, str) else yaml.safe_dump(default).strip().removesuffix("...").strip()
        params.append(Parameter(name=name, value=text, description=f"({spec.type}) {spec.description or ''}".strip()))
    return params


def step_outputs(step: str) -> list[str]:
    """Output names of a step: the fields of the dataclass its ``run`` returns."""
    run = importlib.import_module(MODULES[step]).run
    return [f.name for f in dataclasses.fields(typing.get_type_hints(run)["return"])]


def retry_strategy(step: str, config: RelaunchConfig) -> RetryStrategy:
    """The table's retries; Argo's maxDuration counts from the first attempt's start, so it must
    outlast every attempt (a launch waits up to ``wait_timeout_seconds``) plus the backoffs."""
    policy = EXIT_HANDLER_RETRY if step in EXIT_HANDLER_STEPS else RETRY_POLICIES[step]
    backoffs = sum(min(policy.backoff_seconds * policy.factor**i, policy.max_backoff_seconds) for i in range(policy.limit))
    if step == "launch":
        attempt = int(config.launch.kubernetes.wait_timeout_seconds)
    else:
        attempt = EXIT_HANDLER_ATTEMPT_SECONDS if step in EXIT_HANDLER_STEPS else STEP_ATTEMPT_SECONDS
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


def step_template(step: str, config: RelaunchConfig, inputs: list[str], *,
                  extra_env: dict[str, str] | None = None) -> Container:
    """``python -m components.<step> --config-json ... --input name=... --outputs-dir /tmp/outputs``."""
    k8s = config.launch.kubernetes
    args = ["--config-json", "{{inputs.parameters.config_json}}"]
    for name in inputs:
        args += ["--input", f"{name}={{{{inputs.parameters.{name}}}}}"]
    return Container(
        name=step,
        image=k8s.image,
        image_pull_policy=k8s.image_pull_policy,
        command=["python", "-m", MODULES[step]],
        args=args + ["--outputs-dir", OUTPUTS_DIR],
        inputs=[Parameter(name="config_json")] + [Parameter(name=n) for n in inputs],
        outputs=[Parameter(name=o, value_from=m.ValueFrom(path=f"{OUTPUTS_DIR}/{o}")) for o in step_outputs(step)],
        env=_env(plain_env(k8s) + [{"name": k, "value": v} for k, v in (extra_env or {}).items()] + secret_env(k8s)),
        retry_strategy=retry_strategy(step, config),
    )


def _define(config: RelaunchConfig) -> None:
    """Inside a ``with Workflow(...)``: the templates and the two DAGs (main and exit handler)."""
    params = [p.name for p in pipeline_parameters(config) if p.name != "config_json"]
    prepare = step_template("prepare", config, ["pipeline_run_id", *params])
    locate = step_template("locate-latest-checkpoint", config, [])
    launch = step_template("launch", config, ["resume_from", "pipeline_run_id"],
                           extra_env={var: WORKFLOW_OWNER[field] for field, var in OWNER_ENV.items()})
    evaluate = step_template("evaluate", config, [])
    register = step_template("register", config, ["checkpoint_uri", "metrics_json"])
    finalize = step_template("finalize", config, ["pipeline_run_id", "state", "error"])
    delete_job = step_template(DELETE_JOB, config, ["pipeline_run_id"])

    run_id = "{{workflow.uid}}"
    with DAG(name="relaunch"):
        p = prepare(arguments={"config_json": "{{workflow.parameters.config_json}}", "pipeline_run_id": run_id,
                               **{n: f"{{{{workflow.parameters.{n}}}}}" for n in params}})
        resolved = p.get_parameter("config_json").value
        loc = locate(arguments={"config_json": resolved})
        train = launch(arguments={"config_json": resolved, "pipeline_run_id": run_id,
                                  "resume_from": loc.get_parameter("checkpoint_uri").value})
        ev = evaluate(arguments={"config_json": resolved})
        reg = register(arguments={"config_json": resolved, "checkpoint_uri": ev.get_parameter("checkpoint_uri").value,
                                  "metrics_json": ev.get_parameter("metrics_json").value},
                       when=f"{ev.get_parameter('passed').value} == true")
        p >> loc >> train >> ev >> reg

    with DAG(name="exit-handler"):
        finalize(arguments={"config_json": "{{workflow.parameters.config_json}}", "pipeline_run_id": run_id,
                            "state": "{{=workflow.status == 'Succeeded' ? 'SUCCEEDED' : 'FAILED'}}",
                            "error": "workflow {{workflow.name}} ended {{workflow.status}}"})
        delete_job(arguments={"config_json": "{{workflow.parameters.config_json}}", "pipeline_run_id": run_id},
                   when="{{workflow.status}} != Succeeded")


def _spec(config: RelaunchConfig) -> dict:
    k8s = config.launch.kubernetes
    return dict(
        namespace=k8s.namespace,
        entrypoint="relaunch",
        on_exit="exit-handler",
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
