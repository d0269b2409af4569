"""What a training job is made of and how its end is read, for both cluster backends; pure functions
(no API calls), so :mod:`~components.launchers.pytorchjob`, :mod:`~components.launchers.trainjob`,
the Argo and KFP definitions build from one set of facts: the Secrets and their keys, the plain
environment, resources, names and labels, the owner reference, and the mapping of a failed job's
conditions and pods to the exit-code contract.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from components.core.config import RelaunchConfig
from components.core.classify import classify_pod
from components.core.exitcodes import PERMANENT, RETRYABLE, ExitCode
from components.core.k8s_naming import job_name, run_hash

RUN_LABEL = "relaunch.dev/pipeline-run"
RUN_ANNOTATION = "relaunch.dev/pipeline-run-id"
STEP = "launch"

# The Secrets every relaunch container reads, and the keys (each key equals the variable's name).
STORE_SECRET_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
TRACKING_SECRET_KEYS = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")

# Environment the Argo launch step sets so the job is garbage-collected with its workflow.
OWNER_ENV = {
    "apiVersion": "RELAUNCH_OWNER_API_VERSION",
    "kind": "RELAUNCH_OWNER_KIND",
    "name": "RELAUNCH_OWNER_NAME",
    "uid": "RELAUNCH_OWNER_UID",
}

# Container waiting reasons that no amount of waiting fixes.
UNSTARTABLE_REASONS = frozenset({"InvalidImageName", "CreateContainerConfigError", "CreateContainerError"})


# --------------------------------------------------------------------------- what every manifest shares


def secret_env_sources(k8s) -> list[tuple[str, tuple[str, ...], bool]]:
    """``(secret name, keys, optional)`` of every Secret a relaunch container reads: the one list the
    jobs, the Argo steps and the KFP tasks (:mod:`pipelines.kfp_cluster`) are built from."""
    sources = [(k8s.store_secret, STORE_SECRET_KEYS, False)]
    if k8s.tracking_secret:
        sources.append((k8s.tracking_secret, TRACKING_SECRET_KEYS, True))
    return sources


def secret_env(k8s) -> list[dict[str, Any]]:
    """Credentials as ``secretKeyRef`` env entries (the Secret key equals the variable's name)."""
    env = []
    for secret, keys, optional in secret_env_sources(k8s):
        for key in keys:
            ref: dict[str, Any] = {"name": secret, "key": key}
            if optional:
                ref["optional"] = True
            env.append({"name": key, "valueFrom": {"secretKeyRef": ref}})
    return env


def plain_env(k8s) -> list[dict[str, Any]]:
    """Non-secret environment every relaunch container gets."""
    env = [{"name": "PYTHONUNBUFFERED", "value": "1"}]
    if k8s.store_endpoint:
        env.append({"name": "AWS_ENDPOINT_URL", "value": k8s.store_endpoint})
    return env


def training_env(k8s, pipeline_run_id: str | None) -> list[dict[str, Any]]:
    """The training container's whole environment: plain values, the run id (when there is one: a
    runtime serves many runs), credentials by reference."""
    run = [{"name": "RELAUNCH_PIPELINE_RUN_ID", "value": pipeline_run_id}] if pipeline_run_id else []
    return plain_env(k8s) + run + secret_env(k8s)


def resources(k8s) -> dict[str, dict[str, str]]:
    """Requests equal to limits (a training node is not overcommitted); quantities as strings."""
    limits = {"cpu": str(k8s.cpu), "memory": str(k8s.memory)}
    if k8s.gpus_per_node:
        limits["nvidia.com/gpu"] = str(k8s.gpus_per_node)
    return {"requests": dict(limits), "limits": limits}


def worker_config(config: RelaunchConfig, resume_from: str | None) -> RelaunchConfig:
    """The configuration the workers get: ``resume_from`` folded in (None resumes from the latest)."""
    worker = config.model_copy(deep=True)
    if resume_from:
        worker.train.resume_from = resume_from
    return worker


def supervised(torchrun_args: list[str]) -> list[str]:
    """The container command: torchrun under the supervisor that maps its blanket exit 1 to the
    contract's code (:mod:`components.launchers.supervise`)."""
    return ["python", "-m", "components.launchers.supervise", "torchrun", *torchrun_args]


def job_metadata(config: RelaunchConfig, pipeline_run_id: str, owner: dict | None) -> dict[str, Any]:
    """Name, namespace, labels, run annotation and the optional owner reference of a training job."""
    metadata: dict[str, Any] = {
        "name": job_name(config.name, pipeline_run_id, STEP),
        "namespace": config.launch.kubernetes.namespace,
        "labels": {"app.kubernetes.io/name": "relaunch", "app.kubernetes.io/component": "training",
                   RUN_LABEL: run_hash(pipeline_run_id)},
        "annotations": {RUN_ANNOTATION: pipeline_run_id},
    }
    if owner:
        metadata["ownerReferences"] = [{
            "apiVersion": owner["apiVersion"], "kind": owner["kind"], "name": owner["name"], "uid": owner["uid"],
            "blockOwnerDeletion": False, "controller": False,
        }]
    return metadata


def owner_from_env(environ: dict[str, str] | None = None) -> dict | None:
    """The owner reference the Argo launch step passes in ``RELAUNCH_OWNER_*``, or None."""
    environ = os.environ if environ is None else environ
    owner = {field: environ.get(var, "") for field, var in OWNER_ENV.items()}
    return owner if all(owner.values()) else None


# --------------------------------------------------------------------------- a backend, and a job's state


@dataclass(frozen=True)
class JobState:
    """Where a job stands: ``phase`` is Pending, Suspended, Running, Succeeded or Failed."""

    phase: str
    message: str = ""
    restarts: int = 0
    progress: str = ""  # what the cluster reports of the training's progress (TrainJob trainerStatus)

    @property
    def finished(self) -> bool:
        return self.phase in ("Succeeded", "Failed")


@dataclass(frozen=True)
class JobKind:
    """What differs between PyTorchJob and TrainJob; the launcher is written against this only."""

    group: str
    version: str
    plural: str
    kind: str
    container: str                                  # the training container's name in every pod
    pod_selector: Callable[[str], str]              # job name -> label selector of its pods
    is_node0: Callable[[dict], bool]                # the pod whose log is streamed
    state: Callable[[dict], JobState]               # the job's status -> JobState
    summary: Callable[[dict], str]                  # a short line of replica/job counts

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}"


def describe_conditions(conditions: Iterable[dict]) -> str:
    return "; ".join(
        f"{c.get('type')}={c.get('status')}" + (f" ({c.get('reason')}: {c.get('message')})" if c.get("message") else "")
        for c in conditions
    )


def pod_exit_codes(pods: list[dict], container: str) -> list[tuple[int, str]]:
    """Every ended pod or training container of a job as ``(exit code of the contract, why)``
    (:func:`components.core.classify.classify_pod` of each pod)."""
    return [(int(code), why) for pod in pods for code, why in classify_pod(pod, container)]


def unstartable_reason(pods: list[dict]) -> str | None:
    """A container that can never start (bad image name, missing Secret key): wait no longer."""
    for pod in pods:
        for cs in (pod.get("status") or {}).get("containerStatuses") or []:
            waiting = (cs.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") in UNSTARTABLE_REASONS:
                return f"pod {pod['metadata'].get('name')}: {waiting['reason']}: {waiting.get('message', '')}".strip()
    return None


def unscheduled_reason(pods: list[dict]) -> str | None:
    """Why pods are not placed (``PodScheduled=False``: no node fits, quota), or None."""
    for pod in pods:
        for cond in (pod.get("status") or {}).get("conditions") or []:
            if cond.get("type") == "PodScheduled" and str(cond.get("status")) == "False":
                return f"pod {pod['metadata'].get('name')} not scheduled: {cond.get('reason')}: {cond.get('message', '')}".strip()
    return None


def failure_exit_code(kind: JobKind, job: dict, pods: list[dict]) -> tuple[int, str]:
    """Map a failed job to one exit code of the contract, with the evidence as the message.

    A permanent code anywhere wins (one rank's bad input fails the job for good); then a retryable
    one; a job that ran past its deadline is a timeout (138, like the local launcher); codes outside
    the contract and a failure with no evidence are treated as a bug (1).
    """
    state = kind.state(job)
    codes = pod_exit_codes(pods, kind.container)
    for wanted in (PERMANENT, RETRYABLE):
        for code, why in codes:
            if code in wanted:
                return code, f"{why}; conditions: {state.message}"
    if "deadline" in state.message.lower():
        return int(ExitCode.RETRY_ME), f"job ran past its active deadline; conditions: {state.message}"
    if codes:
        code, why = codes[0]
        return int(ExitCode.BUG), f"{why} (exit code {code} is not in the contract); conditions: {state.message}"
    return int(ExitCode.BUG), f"job failed without an exit code; conditions: {state.message}"
