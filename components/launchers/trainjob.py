"""Launch backend ``trainjob``: one Kubeflow Trainer v2 TrainJob (``trainer.kubeflow.org/v1alpha1``) per
pipeline run, on the ClusterTrainingRuntime ``relaunch-torch`` that relaunch ships, both built from the
``kubeflow-trainer-api`` models. Choose it on Kubeflow releases after 26.03 (Trainer v2.3+).

    relaunch render trainingruntime > manifests/trainer/relaunch-torch.yaml    # applied once per cluster
    relaunch render trainjob -o job.yaml                                        # what launch creates

Both render the neutral :class:`~relaunch.components.launchers.jobs.JobSpec`. How a failure is handled is
derived from its restart policy (the exit-code table, :mod:`relaunch.components.core.contract.exitcodes`), never
written a second time: the training container runs under the supervisor, so its exit code is the
contract's; the Job's ``podFailurePolicy`` fails the Job on any non-zero code, naming which rule
matched (retryable codes, or every other code); the JobSet ``failurePolicy`` restarts the whole
JobSet on the first (up to ``launch.trainjob.max_restarts``) and fails it on the second. The
contract (adopt or create, watch, map the end to an exit code) is :mod:`relaunch.components.launchers.cluster`.
"""

from __future__ import annotations

import re
from typing import Any

from ..core.contract.config import KubernetesConfig, RelaunchConfig, TrainJobConfig
from ..core.trainer.progress import NAMESPACE_ENV, TRAINJOB_ENV
from . import LaunchResult
from . import inplace
from .cluster import launch_job
from .jobs import (
                   JobKind, JobSpec, JobState, RestartPolicy, describe_conditions, job_metadata, job_spec, owner_from_env,
                   secret_file_mounts, secret_file_volumes, supervised, training_env,
                   )

GROUP, VERSION, PLURAL, KIND_NAME = "trainer.kubeflow.org", "v1alpha1", "trainjobs", "TrainJob"
RUNTIME_KIND = "ClusterTrainingRuntime"
NODE = "node"  # the replicated job and container Trainer's torch plugin configures (PET_* env)
JOBSET_LABEL = "jobset.sigs.k8s.io/jobset-name"  # a TrainJob's JobSet has the TrainJob's name
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
# Trainer's torch plugin injects these into the node container; Kubernetes expands $(VAR) in commands.
RDZV_ENDPOINT = "$(PET_MASTER_ADDR):$(PET_MASTER_PORT)"

# The Job controller's message when a podFailurePolicy FailJob rule matched (k8s pkg/controller/job):
# "Container node for pod NS/NAME failed with exit code 143 matching FailJob rule at index 0".
JOB_FAILURE_REASON = "PodFailurePolicy"
RETRYABLE_RULE, PERMANENT_RULE = 0, 1


def matched_rule_pattern(index: int) -> str:
    """The regular expression (Go RE2 and Python alike) of a Job failed by FailJob rule ``index``."""
    return f"matching FailJob rule at index {index}$"


# --------------------------------------------------------------------------- failure rules from the table


def pod_failure_policy(restart: RestartPolicy) -> dict[str, Any]:
    """The Job's ``podFailurePolicy``: retryable codes fail it by rule 0, every other non-zero code by
    rule 1 (unknown codes are permanent, as :func:`~relaunch.components.core.contract.exitcodes.is_retryable` says); a
    pod disrupted before its container ended (preemption, node drain) is replaced without counting."""
    codes = list(restart.retryable_exit_codes)
    rules = [None, None, None]
    rules[RETRYABLE_RULE] = {"action": "FailJob", "onExitCodes": {"containerName": NODE, "operator": "In", "values": codes}}
    rules[PERMANENT_RULE] = {"action": "FailJob", "onExitCodes": {"containerName": NODE, "operator": "NotIn", "values": codes}}
    rules[2] = {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
    return {"rules": rules}


def jobset_failure_policy(max_restarts: int) -> dict[str, Any]:
    """The JobSet ``failurePolicy``: fail for good on a permanent code, restart on a retryable one."""
    return {
        "maxRestarts": max_restarts,
        "rules": [
            {"name": "permanent-exit-code", "action": "FailJobSet", "onJobFailureReasons": [JOB_FAILURE_REASON],
             "onJobFailureMessagePatterns": [matched_rule_pattern(PERMANENT_RULE)]},
            {"name": "retryable-exit-code", "action": "RestartJobSet", "onJobFailureReasons": [JOB_FAILURE_REASON],
             "onJobFailureMessagePatterns": [matched_rule_pattern(RETRYABLE_RULE)]},
        ],
    }


def jobset_action(runtime: dict, exit_code: int) -> str:
    """What Kubernetes and JobSet do with a node container that exited ``exit_code``, read from the
    rendered runtime (the podFailurePolicy, then the JobSet rules): ``FailJobSet``, ``RestartJobSet``
    or, when no Job rule matches, the JobSet default (``RestartJobSet``, counted against maxRestarts)."""
    job_set = runtime["spec"]["template"]["spec"]
    job_spec = job_set["replicatedJobs"][0]["template"]["spec"]
    message = None
    for index, rule in enumerate(job_spec["podFailurePolicy"]["rules"]):
        req = rule.get("onExitCodes")
        if not req or req.get("containerName") not in (None, NODE):
            continue
        matched = exit_code in req["values"] if req["operator"] == "In" else exit_code not in req["values"]
        if matched and rule["action"] == "FailJob":
            message = f"Container {NODE} for pod ns/pod-0 failed with exit code {exit_code} matching FailJob rule at index {index}"
            break
    if message is None:
        return "RestartJobSet"
    for rule in job_set["failurePolicy"]["rules"]:
        if JOB_FAILURE_REASON in rule.get("onJobFailureReasons", [JOB_FAILURE_REASON]) and any(
                re.search(p, message) for p in rule.get("onJobFailureMessagePatterns", [".*"])):
            return rule["action"]
    return "RestartJobSet"


# --------------------------------------------------------------------------- build (no side effects)


def command(spec: JobSpec, name: str) -> list[str]:
    """The supervised torchrun, with the c10d rendezvous on the address Trainer gives node 0; a job with
    ``train.memory_tier``: the supervised in-place agent (its survivors keep their processes), node 0's
    hosting the store on that address (``PET_MASTER_ADDR``, ``PET_MASTER_PORT``, ``PET_NODE_RANK``)."""
    if inplace.memory_tier(spec):
        return inplace.pod_command(spec, name)
    return supervised(spec.torchrun_args(rdzv_endpoint=RDZV_ENDPOINT, rdzv_id=name))


def _dump(model) -> dict:
    return model.to_dict()


def build_runtime(config: RelaunchConfig | None = None) -> dict:
    """The ClusterTrainingRuntime ``launch.trainjob.runtime`` (default ``relaunch-torch``): the stock
    ``torch-distributed`` runtime plus the exit-code failure rules, the supervised entrypoint,
    /dev/shm, the service account, placement and env from Secrets only.

    TrainJobs relaunch creates set their own image, command, env and resources; the runtime's are
    what a TrainJob that names none would run (the configuration this is rendered with).
    """
    config = config or RelaunchConfig()
    return render_runtime(job_spec(config), config.launch.kubernetes, config.launch.trainjob)


def render_runtime(spec: JobSpec, k8s: KubernetesConfig, trainjob: TrainJobConfig) -> dict:
    """The ClusterTrainingRuntime of ``spec`` (see :func:`build_runtime`); ``k8s`` and ``trainjob``
    give only what is Kubernetes' and Trainer's own (service account, placement, JobSet restarts)."""
    from kubeflow_trainer_api import models as t

    pod_spec = {
        "restartPolicy": "Never",  # podFailurePolicy requires it; restarts are the JobSet's
        "serviceAccountName": k8s.service_account,
        "terminationGracePeriodSeconds": k8s.termination_grace_period_seconds,
        "containers": [{
            "name": NODE, "image": spec.image, "imagePullPolicy": spec.image_pull_policy,
            "command": command(spec, trainjob.runtime),
            "env": training_env(spec, None) + inplace.pod_env(spec) + progress_env(),
            "resources": spec.resources.kubernetes(),
            "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}, *secret_file_mounts(spec.secret_files)],
        }],
        "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.resources.shm_size}},
                    *secret_file_volumes(spec.secret_files)],
    }
    if k8s.node_selector:
        pod_spec["nodeSelector"] = dict(k8s.node_selector)
    if k8s.tolerations:
        pod_spec["tolerations"] = [dict(tol) for tol in k8s.tolerations]
    runtime = t.TrainerV1alpha1ClusterTrainingRuntime(
        api_version=f"{GROUP}/{VERSION}", kind=RUNTIME_KIND,
        metadata=t.IoK8sApimachineryPkgApisMetaV1ObjectMeta(
            name=trainjob.runtime,
            labels={"trainer.kubeflow.org/framework": "torch", "app.kubernetes.io/name": "relaunch"}),
        spec=t.TrainerV1alpha1TrainingRuntimeSpec(
            ml_policy=t.TrainerV1alpha1MLPolicy(num_nodes=spec.nodes,
                                                torch=t.TrainerV1alpha1TorchMLPolicySource()),
            template=t.TrainerV1alpha1JobSetTemplateSpec(spec=t.JobsetV1alpha2JobSetSpec(
                failure_policy=t.JobsetV1alpha2FailurePolicy.from_dict(
                    {**jobset_failure_policy(trainjob.max_restarts),
                     # JobSet's in-place restart (alpha, Kubernetes >= 1.35): the pods stay, only failed containers restart
                     **({"restartStrategy": "InPlaceRestart"} if inplace.memory_tier(spec) else {})}),
                ttl_seconds_after_finished=k8s.ttl_seconds_after_finished,
                replicated_jobs=[t.JobsetV1alpha2ReplicatedJob(
                    name=NODE,
                    template=t.IoK8sApiBatchV1JobTemplateSpec.from_dict({
                        "metadata": {"labels": {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}},
                        "spec": {"backoffLimit": 0, "podFailurePolicy": pod_failure_policy(spec.restart),
                                 "template": {"spec": pod_spec}},
                    }))],
            )),
        ))
    return _dump(runtime)


def build_trainjob(config: RelaunchConfig, *, pipeline_run_id: str, resume_from: str | None = None,
                   owner: dict | None = None) -> dict:
    """The TrainJob (trainer.kubeflow.org/v1alpha1) that trains ``config`` for one pipeline run: its
    :func:`~relaunch.components.launchers.jobs.job_spec`, rendered by :func:`render_trainjob`.

    Args:
        config: the resolved configuration; it travels to the workers as ``--config-json`` and holds
            no credentials (those come from the Secrets named in ``launch.kubernetes``).
        pipeline_run_id: Argo ``workflow.uid`` or the KFP run id; the job name is derived from it.
        resume_from: checkpoint URI to start from; None resumes from the latest.
        owner: the owner reference's fields (the Argo Workflow), so deleting the workflow deletes the job.

    Returns:
        The manifest as a plain dict (no ``None`` values), ready for the API or ``yaml.safe_dump``.
    """
    return render_trainjob(job_spec(config, resume_from=resume_from), config.launch.kubernetes,
                           config.launch.trainjob, pipeline_run_id=pipeline_run_id, owner=owner)


def render_trainjob(spec: JobSpec, k8s: KubernetesConfig, trainjob: TrainJobConfig, *, pipeline_run_id: str,
                    owner: dict | None = None) -> dict:
    """The TrainJob of ``spec``; ``k8s`` and ``trainjob`` give the namespace, the deadline, the
    runtime and the Kueue queue."""
    from kubeflow_trainer_api import models as t

    metadata = job_metadata(spec, k8s, pipeline_run_id, owner)
    if trainjob.queue_name:
        metadata["labels"][QUEUE_LABEL] = trainjob.queue_name
    job_spec_model = t.TrainerV1alpha1TrainJobSpec(
        runtime_ref=t.TrainerV1alpha1RuntimeRef(name=trainjob.runtime, kind=RUNTIME_KIND, api_group=GROUP),
        trainer=t.TrainerV1alpha1Trainer(
            image=spec.image,
            command=command(spec, metadata["name"]),
            env=[t.IoK8sApiCoreV1EnvVar.from_dict(e) for e in training_env(spec, pipeline_run_id) + inplace.pod_env(spec)],
            resources_per_node=t.IoK8sApiCoreV1ResourceRequirements.from_dict(spec.resources.kubernetes()),
            num_nodes=spec.nodes, num_proc_per_node=spec.procs_per_node),
        active_deadline_seconds=k8s.active_deadline_seconds)
    job = t.TrainerV1alpha1TrainJob(api_version=f"{GROUP}/{VERSION}", kind=KIND_NAME,
                                    metadata=t.IoK8sApimachineryPkgApisMetaV1ObjectMeta.from_dict(metadata),
                                    spec=job_spec_model)
    return _dump(job)


def progress_env() -> list[dict[str, Any]]:
    """The runtime's pods learn their TrainJob (its JobSet has the TrainJob's name) from the downward API,
    for rank 0's progress reports into the TrainJob's ``status`` (components/core/trainer/progress.py)
    when Trainer's progress server is not offered; the TrainJob itself stays env-equal to a PyTorchJob."""
    return [{"name": TRAINJOB_ENV, "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{JOBSET_LABEL}']"}}},
            {"name": NAMESPACE_ENV, "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}]


# --------------------------------------------------------------------------- read a TrainJob's state


def job_state(job: dict) -> JobState:
    """Complete / Failed end it; Suspended (spec.suspend, e.g. Kueue has not admitted it) waits;
    a child Job with active pods means Running. ``trainerStatus`` progress is read when reported."""
    status = job.get("status") or {}
    conditions = status.get("conditions") or []
    true = {c.get("type") for c in conditions if str(c.get("status")) == "True"}
    message = describe_conditions(conditions)
    progress = _progress(status.get("trainerStatus") or {})
    if "Failed" in true:
        return JobState("Failed", message, progress=progress)
    if "Complete" in true:
        return JobState("Succeeded", message, progress=progress)
    if "Suspended" in true or (job.get("spec") or {}).get("suspend"):
        return JobState("Suspended", message, progress=progress)
    running = any((j.get("active") or 0) + (j.get("ready") or 0) for j in status.get("jobsStatus") or [])
    return JobState("Running" if running else "Pending", message, progress=progress)


def _progress(trainer: dict) -> str:
    parts = []
    if trainer.get("progressPercentage") is not None:
        parts.append(f"{trainer['progressPercentage']}%")
    if trainer.get("estimatedRemainingSeconds") is not None:
        parts.append(f"~{trainer['estimatedRemainingSeconds']} s left")
    parts += [f"{m['name']}={m['value']}" for m in trainer.get("metrics") or [] if "name" in m]
    return " ".join(parts)


def jobs_summary(job: dict) -> str:
    """``node: active=2`` from ``status.jobsStatus``."""
    parts = []
    for child in (job.get("status") or {}).get("jobsStatus") or []:
        counts = {k: v for k, v in sorted(child.items()) if isinstance(v, int) and v}
        parts.append(f"{child.get('name')}: " + (" ".join(f"{k}={v}" for k, v in counts.items()) or "none"))
    return "; ".join(parts)


def _is_node0(pod: dict) -> bool:
    labels = pod.get("metadata", {}).get("labels") or {}
    return labels.get(COMPLETION_INDEX) == "0" and labels.get("jobset.sigs.k8s.io/job-index", "0") == "0"


KIND = JobKind(
    group=GROUP, version=VERSION, plural=PLURAL, kind=KIND_NAME, container=NODE,
    pod_selector=lambda name: f"{JOBSET_LABEL}={name}", is_node0=_is_node0, state=job_state, summary=jobs_summary,
)


def launch(config: RelaunchConfig, *, pipeline_run_id: str, resume_from: str | None) -> LaunchResult:
    """Train ``config`` as a TrainJob and wait for it; same contract as every backend."""
    def build(resume: str | None) -> dict:
        return build_trainjob(config, pipeline_run_id=pipeline_run_id, resume_from=resume, owner=owner_from_env())

    return launch_job(KIND, build, config, resume_from)


def render(config: RelaunchConfig, run_id: str) -> dict:
    """``relaunch render trainjob``: the TrainJob launch would create for pipeline run ``run_id``."""
    return build_trainjob(config, pipeline_run_id=run_id)


def render_training_runtime(config: RelaunchConfig, run_id: str) -> dict:
    """``relaunch render trainingruntime``: the ClusterTrainingRuntime to apply once per cluster."""
    return build_runtime(config)
