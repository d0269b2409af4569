"""Launch backend ``rayjob``: one KubeRay ``RayJob`` (``ray.io/v1``, KubeRay 1.7) per pipeline run, running the
``ray`` backend's driver (:mod:`relaunch.components.launchers.ray`) on a Ray cluster KubeRay creates for it.

    relaunch render rayjob -o rayjob.yaml --set launch.nodes=4

A separate backend from ``ray``, as ``pytorchjob``/``trainjob`` are from ``local``: ``ray`` starts and owns a Ray
cluster on this machine, ``rayjob`` asks a Kubernetes cluster for one (``cluster=True``: the pipeline's exit handler
deletes it, :func:`relaunch.components.launchers.cluster.delete_job`). Head and worker groups come from the neutral
:class:`~relaunch.components.launchers.jobs.JobSpec` (image, per-node resources and GPUs, env and Secrets), the
rest from ``launch.kubernetes`` (namespace, service account, node selector, tolerations, TTL, deadline, backoff
limit). The name is the pipeline run's (:func:`~relaunch.components.launchers.k8s_naming.job_name`), so a retried
launch step adopts the RayJob it created instead of starting one whose checkpoints it cannot see (kuberay#2155).
Ray's token authentication is on (``authOptions.mode: token``: KubeRay makes the token Secret).

How it ended: ``jobDeploymentStatus`` ``Complete`` with ``jobStatus`` ``SUCCEEDED`` succeeds; ``Failed`` (or
``Complete`` with another ``jobStatus``) fails with the code the training recorded in the store
(``runs/exit.json``, written by the trainer after the RayJob was created: ``ray job submit`` and the Ray job status
only say "failed"), else the pods' codes as for the other cluster backends, else 137 (the driver died without
control); ``DeadlineExceeded`` is a retryable 138.
"""

from __future__ import annotations

import datetime
import shlex
from typing import Any

from ..core.contract.classify import torchrun_exit
from ..core.contract.config import KubernetesConfig, RelaunchConfig
from ..core.contract.errors import RelaunchError
from ..core.contract.exitcodes import ExitCode
from ..core.store import open_store
from ..core.store.records import read_exit_record
from . import LaunchResult
from .cluster import launch_job
from .jobs import (
                   RUN_LABEL, JobKind, JobSpec, JobState, failure_exit_code, job_metadata, job_spec, owner_from_env, pod_exit_codes,
                   secret_file_mounts, secret_file_volumes, training_env,
                   )
from .ray import driver_command

GROUP, VERSION, PLURAL, KIND_NAME = "ray.io", "v1", "rayjobs", "RayJob"
KUBERAY_VERSION = "1.7.0"
CR_LABEL = "ray.io/originated-from-cr-name"  # KubeRay labels every pod of the RayJob's cluster with it
HEAD_CONTAINER = "ray-head"
WORKER_CONTAINER = "ray-worker"
WORKER_GROUP = "nodes"


def job_state(job: dict) -> JobState:
    """``jobDeploymentStatus`` / ``jobStatus`` as a :class:`JobState`; ``failed`` counts KubeRay's retries."""
    status = job.get("status") or {}
    deployment, ray_status = status.get("jobDeploymentStatus") or "", status.get("jobStatus") or ""
    message = "; ".join(f"{k}={status[k]}" for k in ("jobDeploymentStatus", "jobStatus", "reason", "message")
                        if status.get(k))
    restarts = int(status.get("failed") or 0)
    if deployment == "Complete":
        return JobState("Succeeded" if ray_status == "SUCCEEDED" else "Failed", message, restarts)
    if deployment in ("Failed", "ValidationFailed"):
        return JobState("Failed", message, restarts)
    if deployment in ("Suspended", "Suspending"):
        return JobState("Suspended", message, restarts)
    if deployment in ("Running", "Retrying") or ray_status == "RUNNING":
        return JobState("Running", message, restarts)
    return JobState("Pending", message, restarts)


def summary(job: dict) -> str:
    status = job.get("status") or {}
    return " ".join(f"{k}={status[k]}" for k in ("jobStatus", "rayClusterName") if status.get(k))


KIND = JobKind(
    group=GROUP, version=VERSION, plural=PLURAL, kind=KIND_NAME, container=HEAD_CONTAINER,
    pod_selector=lambda name: f"{CR_LABEL}={name}",
    is_node0=lambda pod: (pod["metadata"].get("labels") or {}).get("ray.io/node-type") == "head",
    state=job_state, summary=summary,
)


def failure(config: RelaunchConfig):
    """``(job, pods) -> (exit code, why)`` of a failed RayJob of ``config``: the training's own record first."""
    def mapped(job: dict, pods: list[dict]) -> tuple[int, str]:
        state = job_state(job)
        if (job.get("status") or {}).get("reason") == "DeadlineExceeded":
            return int(ExitCode.RETRY_ME), f"job ran past its active deadline; {state.message}"
        try:
            record = read_exit_record(open_store(config.store.uri))
        except RelaunchError as err:
            return int(ExitCode.RETRY_ME), f"cannot read the training's exit record ({err}); {state.message}"
        if record is not None and record.get("time", 0) >= _created(job):
            code = torchrun_exit(1, record, _created(job))
            return code, f"the training recorded exit code {code}; {state.message}"
        if not pod_exit_codes(pods, HEAD_CONTAINER):  # the driver died without control (head lost, OOM)
            return int(ExitCode.KILLED), f"no exit record of this RayJob's training and no pod exit code; {state.message}"
        return failure_exit_code(KIND, job, pods)

    return mapped


def _created(job: dict) -> float:
    stamp = (job.get("metadata") or {}).get("creationTimestamp")
    try:
        return datetime.datetime.fromisoformat(str(stamp).replace("Z", "+00:00")).timestamp() if stamp else 0.0
    except ValueError:
        return 0.0


def build_rayjob(config: RelaunchConfig, *, pipeline_run_id: str, resume_from: str | None = None,
                 owner: dict | None = None) -> dict:
    """The RayJob (ray.io/v1) that trains ``config`` for one pipeline run (a plain dict, no ``None`` values)."""
    return render_rayjob(job_spec(config, resume_from=resume_from), config.launch.kubernetes,
                         pipeline_run_id=pipeline_run_id, owner=owner)


def render_rayjob(spec: JobSpec, k8s: KubernetesConfig, *, pipeline_run_id: str, owner: dict | None = None) -> dict:
    """The RayJob of ``spec``: a head group (node 0) and ``nodes - 1`` workers, each a node of the spec."""
    metadata = job_metadata(spec, k8s, pipeline_run_id, owner)
    name = metadata["name"]
    env = training_env(spec, pipeline_run_id)

    def pod(container: str) -> dict[str, Any]:
        body: dict[str, Any] = {
            "name": container, "image": spec.image, "imagePullPolicy": spec.image_pull_policy, "env": env,
            "resources": spec.resources.kubernetes(),
            "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}, *secret_file_mounts(spec.secret_files)],
        }
        pod_spec: dict[str, Any] = {
            "serviceAccountName": k8s.service_account,
            "terminationGracePeriodSeconds": k8s.termination_grace_period_seconds,
            "containers": [body],
            "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.resources.shm_size}},
                        *secret_file_volumes(spec.secret_files)],
        }
        if k8s.node_selector:
            pod_spec["nodeSelector"] = dict(k8s.node_selector)
        if k8s.tolerations:
            pod_spec["tolerations"] = [dict(t) for t in k8s.tolerations]
        return {"metadata": {"labels": {RUN_LABEL: metadata["labels"][RUN_LABEL]}},
                "spec": {k: v for k, v in pod_spec.items() if v is not None}}

    # Each Ray node offers one node's ranks (the driver's placement group asks a bundle of this per node).
    start = {"num-cpus": str(spec.procs_per_node), "block": "true"}
    if spec.resources.gpus:
        start["num-gpus"] = str(spec.resources.gpus)
    cluster: dict[str, Any] = {
        "authOptions": {"mode": "token"},
        "headGroupSpec": {"rayStartParams": dict(start), "template": pod(HEAD_CONTAINER)},
    }
    if spec.nodes > 1:
        cluster["workerGroupSpecs"] = [{"groupName": WORKER_GROUP, "replicas": spec.nodes - 1,
                                        "minReplicas": spec.nodes - 1, "maxReplicas": spec.nodes - 1,
                                        "rayStartParams": dict(start), "template": pod(WORKER_CONTAINER)}]
    entrypoint = shlex.join(driver_command(spec, address="auto", job_id=name, python="python"))
    job_body: dict[str, Any] = {
        "entrypoint": entrypoint,
        "shutdownAfterJobFinishes": True,
        "ttlSecondsAfterFinished": k8s.ttl_seconds_after_finished,
        "backoffLimit": k8s.backoff_limit,
        "rayClusterSpec": cluster,
    }
    if k8s.active_deadline_seconds:
        job_body["activeDeadlineSeconds"] = k8s.active_deadline_seconds
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND_NAME, "metadata": metadata,
            "spec": {k: v for k, v in job_body.items() if v is not None}}


def launch(config: RelaunchConfig, *, pipeline_run_id: str, resume_from: str | None) -> LaunchResult:
    """Train ``config`` as a RayJob and wait for it; same contract as every backend."""
    def build(resume: str | None) -> dict:
        return build_rayjob(config, pipeline_run_id=pipeline_run_id, resume_from=resume, owner=owner_from_env())

    return launch_job(KIND, build, config, resume_from, failure=failure(config))


def render(config: RelaunchConfig, run_id: str) -> dict:
    """``relaunch render rayjob``: the RayJob launch would create for pipeline run ``run_id``."""
    return build_rayjob(config, pipeline_run_id=run_id)
