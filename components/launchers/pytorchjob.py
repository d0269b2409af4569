"""Launch backend ``pytorchjob``: one Kubeflow PyTorchJob (Training Operator v1, ``kubeflow.org/v1``) per
pipeline run, built from the ``kubeflow-training`` SDK's models. Choose it on clusters that still run
the Training Operator (Kubeflow up to 26.03); newer installs run Trainer v2 (backend ``trainjob``).

    relaunch render pytorchjob -o job.yaml --set launch.nodes=4

The contract (adopt or create, watch, map the end to an exit code) is :mod:`relaunch.components.launchers.cluster`;
what the job is made of, the neutral :class:`~relaunch.components.launchers.jobs.JobSpec` this module renders.
"""

from __future__ import annotations

from typing import Any

from ..core.contract.config import KubernetesConfig, RelaunchConfig
from . import LaunchResult, inplace
from .cluster import launch_job
from .jobs import (
                   RUN_LABEL, JobKind, JobSpec, JobState, describe_conditions, job_metadata, job_spec, owner_from_env, supervised,
                   secret_file_mounts, secret_file_volumes, training_env,
                   )

GROUP, VERSION, PLURAL, KIND_NAME = "kubeflow.org", "v1", "pytorchjobs", "PyTorchJob"
JOB_LABEL = "training.kubeflow.org/job-name"  # set by the Training Operator on every replica pod
RDZV_PORT = 23456  # the Training Operator's default "pytorchjob-port"
CONTAINER = "pytorch"  # the Training Operator finds the training container by this name


def job_state(job: dict) -> JobState:
    """Read the job's conditions; the newest true Succeeded/Failed condition ends it. ``Suspended``
    (runPolicy.suspend, set by Kueue until it admits the job) waits like a TrainJob's."""
    conditions = (job.get("status") or {}).get("conditions") or []
    true = [c for c in conditions if str(c.get("status")) == "True"]
    restarts = sum(1 for c in conditions if c.get("type") == "Restarting")
    for cond in reversed(true):
        if cond.get("type") in ("Succeeded", "Failed"):
            return JobState(cond["type"], describe_conditions(conditions), restarts)
    running = any(c.get("type") == "Running" for c in true)
    suspended = any(c.get("type") == "Suspended" for c in true)
    phase = "Suspended" if suspended and not running else "Running" if running else "Pending"
    return JobState(phase, describe_conditions(conditions), restarts)


def replica_summary(job: dict) -> str:
    """``Master: active=1; Worker: failed=1`` from ``status.replicaStatuses``."""
    statuses = (job.get("status") or {}).get("replicaStatuses") or {}
    parts = []
    for role in sorted(statuses):
        counts = {k: v for k, v in sorted(statuses[role].items()) if isinstance(v, int) and v}
        parts.append(f"{role}: " + (" ".join(f"{k}={v}" for k, v in counts.items()) or "none"))
    return "; ".join(parts)


KIND = JobKind(
    group=GROUP, version=VERSION, plural=PLURAL, kind=KIND_NAME, container=CONTAINER,
    pod_selector=lambda name: f"{JOB_LABEL}={name}",
    is_node0=lambda pod: pod["metadata"]["name"].endswith("-master-0"),
    state=job_state, summary=replica_summary,
)


def command(spec: JobSpec, name: str) -> list[str]:
    """The supervised torchrun, with the c10d rendezvous on the master replica's stable DNS name; with
    ``train.memory_tier``, the supervised in-place agent, the master's hosting the store there (each
    pod's node rank from the Training Operator's ``PET_NODE_RANK``)."""
    if inplace.memory_tier(spec):
        return inplace.pod_command(spec, name, master_addr=f"{name}-master-0", master_port=RDZV_PORT)
    return supervised(spec.torchrun_args(rdzv_endpoint=f"{name}-master-0:{RDZV_PORT}", rdzv_id=name))


def build_pytorchjob(config: RelaunchConfig, *, pipeline_run_id: str, resume_from: str | None = None,
                     owner: dict | None = None) -> dict:
    """The PyTorchJob (kubeflow.org/v1) that trains ``config`` for one pipeline run: its
    :func:`~relaunch.components.launchers.jobs.job_spec`, rendered by :func:`render_pytorchjob`.

    Args:
        config: the resolved configuration; it travels to the workers as ``--config-json`` and holds
            no credentials (those come from the Secrets named in ``launch.kubernetes``).
        pipeline_run_id: Argo ``workflow.uid`` or the KFP run id; the job name is derived from it.
        resume_from: checkpoint URI to start from (``train.resume_from``); None resumes from the latest.
        owner: ``{"apiVersion", "kind", "name", "uid"}`` of the object that owns the job (the Argo
            Workflow), so deleting the workflow deletes the job.

    Returns:
        The manifest as a plain dict (no ``None`` values), ready for the API or ``yaml.safe_dump``.
    """
    return render_pytorchjob(job_spec(config, resume_from=resume_from), config.launch.kubernetes,
                             pipeline_run_id=pipeline_run_id, owner=owner)


def render_pytorchjob(spec: JobSpec, k8s: KubernetesConfig, *, pipeline_run_id: str, owner: dict | None = None) -> dict:
    """The PyTorchJob of ``spec``; ``k8s`` gives only what is Kubernetes' own (namespace, service
    account, placement, grace period, the run policy's limits)."""
    from kubeflow.training import models as kf
    from kubernetes import client as k

    metadata = job_metadata(spec, k8s, pipeline_run_id, owner)
    name = metadata["name"]
    run_labels = {RUN_LABEL: metadata["labels"][RUN_LABEL]}
    container = k.V1Container(
        name=CONTAINER, image=spec.image, image_pull_policy=spec.image_pull_policy,
        command=command(spec, name),
        env=training_env(spec, pipeline_run_id) + inplace.pod_env(spec),
        ports=[k.V1ContainerPort(name="pytorchjob-port", container_port=RDZV_PORT)],
        resources=k.V1ResourceRequirements(**spec.resources.kubernetes()),
        volume_mounts=[k.V1VolumeMount(name="dshm", mount_path="/dev/shm"), *secret_file_mounts(spec.secret_files)])
    pod = k.V1PodTemplateSpec(
        metadata=k.V1ObjectMeta(labels=run_labels),
        spec=k.V1PodSpec(
            service_account_name=k8s.service_account,
            termination_grace_period_seconds=k8s.termination_grace_period_seconds,
            containers=[container],
            volumes=[k.V1Volume(name="dshm", empty_dir=k.V1EmptyDirVolumeSource(medium="Memory",
                                                                                size_limit=spec.resources.shm_size)),
                     *secret_file_volumes(spec.secret_files)],
            node_selector=dict(k8s.node_selector) or None,
            tolerations=[dict(t) for t in k8s.tolerations] or None))

    def replicas(count: int) -> Any:
        # restartPolicy ExitCode: retry 130/137/138/143 in place, never 1/2/3 (relaunch.components.core.contract.exitcodes)
        return kf.KubeflowOrgV1ReplicaSpec(replicas=count, restart_policy="ExitCode", template=pod)

    replica_specs = {"Master": replicas(1)}
    if spec.nodes > 1:
        replica_specs["Worker"] = replicas(spec.nodes - 1)
    job = kf.KubeflowOrgV1PyTorchJob(
        api_version=f"{GROUP}/{VERSION}", kind=KIND_NAME,
        metadata=k.V1ObjectMeta(name=metadata["name"], namespace=metadata["namespace"], labels=metadata["labels"],
                                annotations=metadata["annotations"], owner_references=metadata.get("ownerReferences")),
        spec=kf.KubeflowOrgV1PyTorchJobSpec(
            elastic_policy=kf.KubeflowOrgV1ElasticPolicy(
                rdzv_backend="c10d", min_replicas=spec.min_nodes, max_replicas=spec.nodes,
                max_restarts=spec.restart.max_restarts, n_proc_per_node=spec.procs_per_node),
            run_policy=kf.KubeflowOrgV1RunPolicy(
                backoff_limit=k8s.backoff_limit, clean_pod_policy=k8s.clean_pod_policy,
                ttl_seconds_after_finished=k8s.ttl_seconds_after_finished,
                active_deadline_seconds=k8s.active_deadline_seconds),
            pytorch_replica_specs=replica_specs))
    return k.ApiClient().sanitize_for_serialization(job)


def launch(config: RelaunchConfig, *, pipeline_run_id: str, resume_from: str | None) -> LaunchResult:
    """Train ``config`` as a PyTorchJob and wait for it; same contract as every backend."""
    def build(resume: str | None) -> dict:
        return build_pytorchjob(config, pipeline_run_id=pipeline_run_id, resume_from=resume, owner=owner_from_env())

    return launch_job(KIND, build, config, resume_from)


def render(config: RelaunchConfig, run_id: str) -> dict:
    """``relaunch render pytorchjob``: the PyTorchJob launch would create for pipeline run ``run_id``."""
    return build_pytorchjob(config, pipeline_run_id=run_id)
