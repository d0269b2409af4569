"""The ``kubernetes`` launch backend: one Kubeflow PyTorchJob per pipeline run, adopted on retry.

    relaunch render pytorchjob -o job.yaml                  # what would be created, for review
    python -m components.launch --config-json '...' --set launch.backend=kubernetes \
        --input pipeline_run_id=$WORKFLOW_UID --input resume_from=s3://...

Build, then act: :func:`build_pytorchjob` is a pure function of the configuration; :func:`launch`
creates or adopts the job, waits on a watch, and maps how it ended to the exit-code contract.

Adopt or create (the job name is derived from the pipeline run id, so a retried step finds it):

=========================  ===================================================================
job found                  what launch does
=========================  ===================================================================
none                       create it (a 409 on create means another attempt won: adopt it)
running / pending          adopt it and keep waiting
succeeded                  succeed
failed, retryable cause    delete it and create it again, once per attempt (training resumes
                           from the latest committed checkpoint)
failed, permanent cause    fail with that exit code
=========================  ===================================================================
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from components.core.config import RelaunchConfig
from components.core.errors import BadInput
from components.core.exitcodes import PERMANENT, RETRYABLE, ExitCode, normalize
from components.core.k8s_naming import job_name, run_hash
from components.launchers import LaunchResult

GROUP, VERSION, PLURAL, KIND = "kubeflow.org", "v1", "pytorchjobs", "PyTorchJob"
JOB_LABEL = "training.kubeflow.org/job-name"  # set by the Training Operator on every replica pod
RUN_LABEL = "relaunch.dev/pipeline-run"
RUN_ANNOTATION = "relaunch.dev/pipeline-run-id"
RDZV_PORT = 23456  # the Training Operator's default "pytorchjob-port"
STEP = "launch"

# Environment the Argo launch step sets so the job is garbage-collected with its workflow.
OWNER_ENV = {
    "apiVersion": "RELAUNCH_OWNER_API_VERSION",
    "kind": "RELAUNCH_OWNER_KIND",
    "name": "RELAUNCH_OWNER_NAME",
    "uid": "RELAUNCH_OWNER_UID",
}

# Pod-level reasons (status.reason) meaning "the pod was taken away", not "the program failed".
PREEMPTION_REASONS = frozenset({"Evicted", "Preempting", "NodeLost", "NodeShutdown", "Shutdown",
                                "Terminated", "DeletionByTaintManager", "DeletionByPodGC", "UnexpectedAdmissionError"})
# Container waiting reasons that no amount of waiting fixes.
UNSTARTABLE_REASONS = frozenset({"InvalidImageName", "CreateContainerConfigError", "CreateContainerError"})


# --------------------------------------------------------------------------- build (no side effects)


def secret_env(k8s) -> list[dict[str, Any]]:
    """Credentials as ``secretKeyRef`` env entries (the Secret key equals the variable's name).

    Shared by the PyTorchJob, the Argo steps and the KFP tasks, so all read the same Secrets.
    """
    env = [
        {"name": key, "valueFrom": {"secretKeyRef": {"name": k8s.store_secret, "key": key}}}
        for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
    ]
    if k8s.tracking_secret:
        env += [
            {"name": key, "valueFrom": {"secretKeyRef": {"name": k8s.tracking_secret, "key": key, "optional": True}}}
            for key in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")
        ]
    return env


def plain_env(k8s) -> list[dict[str, Any]]:
    """Non-secret environment every relaunch container gets."""
    env = [{"name": "PYTHONUNBUFFERED", "value": "1"}]
    if k8s.store_endpoint:
        env.append({"name": "AWS_ENDPOINT_URL", "value": k8s.store_endpoint})
    return env


def torchrun_command(config: RelaunchConfig, name: str, config_json: str) -> list[str]:
    """The worker command: c10d rendezvous on the master replica's stable DNS name, under the
    supervisor that turns torchrun's blanket exit 1 into the contract's code for ``restartPolicy: ExitCode``."""
    launch = config.launch
    min_nodes = launch.min_nodes or launch.nodes
    return [
        "python", "-m", "components.launchers.supervise",
        "torchrun",
        f"--nnodes={min_nodes}:{launch.nodes}",
        f"--nproc-per-node={launch.procs_per_node}",
        f"--max-restarts={launch.max_restarts}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={name}-master-0:{RDZV_PORT}",
        f"--rdzv-id={name}",
        f"--monitor-interval={launch.monitor_interval_seconds:g}",
        "-m", "components.train",
        "--config-json", config_json,
    ]


def _replica_spec(config: RelaunchConfig, name: str, replicas: int, command: list[str], run_id: str) -> dict[str, Any]:
    k8s = config.launch.kubernetes
    limits: dict[str, Any] = {"cpu": k8s.cpu, "memory": k8s.memory}
    if k8s.gpus_per_node:
        limits["nvidia.com/gpu"] = k8s.gpus_per_node
    pod_spec: dict[str, Any] = {
        "serviceAccountName": k8s.service_account,
        "terminationGracePeriodSeconds": k8s.termination_grace_period_seconds,
        "containers": [{
            "name": "pytorch",  # the Training Operator finds the training container by this name
            "image": k8s.image,
            "imagePullPolicy": k8s.image_pull_policy,
            "command": command,
            "env": plain_env(k8s) + [{"name": "RELAUNCH_PIPELINE_RUN_ID", "value": run_id}] + secret_env(k8s),
            "ports": [{"name": "pytorchjob-port", "containerPort": RDZV_PORT}],
            "resources": {"requests": dict(limits), "limits": limits},
            "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
        }],
        "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": k8s.shm_size}}],
    }
    if k8s.node_selector:
        pod_spec["nodeSelector"] = dict(k8s.node_selector)
    if k8s.tolerations:
        pod_spec["tolerations"] = [dict(t) for t in k8s.tolerations]
    return {
        "replicas": replicas,
        "restartPolicy": "ExitCode",  # retry 130/137/138/143 in place, never 1/2/3 (components.core.exitcodes)
        "template": {"metadata": {"labels": {RUN_LABEL: run_hash(run_id)}}, "spec": pod_spec},
    }


def build_pytorchjob(config: RelaunchConfig, *, pipeline_run_id: str, resume_from: str | None = None,
                     owner: dict | None = None) -> dict:
    """The PyTorchJob (kubeflow.org/v1) that trains ``config`` for one pipeline run.

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
    launch = config.launch
    k8s = launch.kubernetes
    name = job_name(config.name, pipeline_run_id, STEP)
    worker_config = config.model_copy(deep=True)
    if resume_from:
        worker_config.train.resume_from = resume_from
    command = torchrun_command(config, name, worker_config.to_json())
    replica_specs = {"Master": _replica_spec(config, name, 1, command, pipeline_run_id)}
    if launch.nodes > 1:
        replica_specs["Worker"] = _replica_spec(config, name, launch.nodes - 1, command, pipeline_run_id)
    run_policy: dict[str, Any] = {
        "backoffLimit": k8s.backoff_limit,
        "cleanPodPolicy": k8s.clean_pod_policy,
        "ttlSecondsAfterFinished": k8s.ttl_seconds_after_finished,
    }
    if k8s.active_deadline_seconds is not None:
        run_policy["activeDeadlineSeconds"] = k8s.active_deadline_seconds
    metadata: dict[str, Any] = {
        "name": name,
        "namespace": k8s.namespace,
        "labels": {"app.kubernetes.io/name": "relaunch", "app.kubernetes.io/component": "training",
                   RUN_LABEL: run_hash(pipeline_run_id)},
        "annotations": {RUN_ANNOTATION: pipeline_run_id},
    }
    if owner:
        metadata["ownerReferences"] = [{
            "apiVersion": owner["apiVersion"], "kind": owner["kind"], "name": owner["name"], "uid": owner["uid"],
            "blockOwnerDeletion": False, "controller": False,
        }]
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "metadata": metadata,
        "spec": {
            "elasticPolicy": {
                "rdzvBackend": "c10d",
                "minReplicas": launch.min_nodes or launch.nodes,
                "maxReplicas": launch.nodes,
                "maxRestarts": launch.max_restarts,
                "nProcPerNode": launch.procs_per_node,
            },
            "runPolicy": run_policy,
            "pytorchReplicaSpecs": replica_specs,
        },
    }


def owner_from_env(environ: dict[str, str] | None = None) -> dict | None:
    """The owner reference the Argo launch step passes in ``RELAUNCH_OWNER_*``, or None."""
    environ = os.environ if environ is None else environ
    owner = {field: environ.get(var, "") for field, var in OWNER_ENV.items()}
    return owner if all(owner.values()) else None


# --------------------------------------------------------------------------- read a job's state


@dataclass(frozen=True)
class JobState:
    """Where a PyTorchJob stands: ``phase`` is Pending, Running, Succeeded or Failed."""

    phase: str
    message: str = ""
    restarts: int = 0

    @property
    def finished(self) -> bool:
        return self.phase in ("Succeeded", "Failed")


def job_state(job: dict) -> JobState:
    """Read the job's conditions; the newest true Succeeded/Failed condition ends it."""
    conditions = (job.get("status") or {}).get("conditions") or []
    true = [c for c in conditions if str(c.get("status")) == "True"]
    restarts = sum(1 for c in conditions if c.get("type") == "Restarting")
    for cond in reversed(true):
        if cond.get("type") in ("Succeeded", "Failed"):
            return JobState(cond["type"], _describe_conditions(conditions), restarts)
    running = any(c.get("type") == "Running" for c in true)
    return JobState("Running" if running else "Pending", _describe_conditions(conditions), restarts)


def _describe_conditions(conditions: Iterable[dict]) -> str:
    return "; ".join(
        f"{c.get('type')}={c.get('status')}" + (f" ({c.get('reason')}: {c.get('message')})" if c.get("message") else "")
        for c in conditions
    )


def replica_summary(job: dict) -> str:
    """``Master: active=1; Worker: failed=1`` from ``status.replicaStatuses``."""
    statuses = (job.get("status") or {}).get("replicaStatuses") or {}
    parts = []
    for role in sorted(statuses):
        counts = {k: v for k, v in sorted(statuses[role].items()) if isinstance(v, int) and v}
        parts.append(f"{role}: " + (" ".join(f"{k}={v}" for k, v in counts.items()) or "none"))
    return "; ".join(parts)


def pod_exit_codes(pods: list[dict]) -> list[tuple[int, str]]:
    """Every ended pod or container of a job as ``(exit code of the contract, why)``.

    OOMKilled is 137 whatever the runtime reported; a pod taken away with its node (Evicted,
    preempted, node shutdown) is 143, retryable, even without a container exit code.
    """
    found: list[tuple[int, str]] = []
    for pod in pods:
        pod_name = pod.get("metadata", {}).get("name", "?")
        status = pod.get("status") or {}
        reason = status.get("reason") or ""
        if reason in PREEMPTION_REASONS:
            found.append((int(ExitCode.PREEMPTED), f"pod {pod_name} {reason}: {status.get('message', '')}".strip()))
            continue
        for cs in status.get("containerStatuses") or []:
            if cs.get("name") not in (None, "pytorch"):
                continue
            for state_key in ("state", "lastState"):
                term = (cs.get(state_key) or {}).get("terminated")
                if not term or term.get("exitCode") in (None, 0):
                    continue
                if term.get("reason") == "OOMKilled":
                    found.append((int(ExitCode.KILLED), f"pod {pod_name} OOMKilled"))
                else:
                    code = normalize(int(term["exitCode"]))
                    found.append((code, f"pod {pod_name} exited {code} ({term.get('reason') or 'Error'})"))
                break
    return found


def unstartable_reason(pods: list[dict]) -> str | None:
    """A container that can never start (bad image name, missing Secret key): wait no longer."""
    for pod in pods:
        for cs in (pod.get("status") or {}).get("containerStatuses") or []:
            waiting = (cs.get("state") or {}).get("waiting") or {}
            if waiting.get("reason") in UNSTARTABLE_REASONS:
                return f"pod {pod['metadata'].get('name')}: {waiting['reason']}: {waiting.get('message', '')}".strip()
    return None


def failure_exit_code(job: dict, pods: list[dict]) -> tuple[int, str]:
    """Map a failed job to one exit code of the contract, with the evidence as the message.

    A permanent code anywhere wins (one rank's bad input fails the job for good); then a retryable
    one; a job that ran past ``activeDeadlineSeconds`` is a timeout (138, like the local launcher);
    codes outside the contract and a failure with no evidence are treated as a bug (1).
    """
    state = job_state(job)
    codes = pod_exit_codes(pods)
    for wanted in (PERMANENT, RETRYABLE):
        for code, why in codes:
            if code in wanted:
                return code, f"{why}; conditions: {state.message}"
    if "deadline" in state.message.lower():
        return int(ExitCode.RETRY_ME), f"job ran past activeDeadlineSeconds; conditions: {state.message}"
    if codes:
        code, why = codes[0]
        return int(ExitCode.BUG), f"{why} (exit code {code} is not in the contract); conditions: {state.message}"
    return int(ExitCode.BUG), f"job failed without an exit code; conditions: {state.message}"


# --------------------------------------------------------------------------- act (API calls)


def kube_api_client():
    """An API client from the pod's service account, else from KUBECONFIG / ~/.kube/config."""
    from kubernetes import client, config as kconfig

    try:
        if os.environ.get("KUBERNETES_SERVICE_HOST"):
            kconfig.load_incluster_config()
        else:
            # KUBECONFIG is read here, not at import time as the library's default does.
            kconfig.load_kube_config(config_file=os.environ.get("KUBECONFIG") or None)
    except (kconfig.ConfigException, OSError) as err:
        raise BadInput(f"no Kubernetes credentials: {err}; set KUBECONFIG or run in a pod with a service account") from None
    return client.ApiClient()


class JobClient:
    """The few PyTorchJob and pod calls the launcher makes, on one namespace."""

    def __init__(self, api_client, namespace: str) -> None:
        from kubernetes import client

        self.custom = client.CustomObjectsApi(api_client)
        self.core = client.CoreV1Api(api_client)
        self.namespace = namespace

    def get(self, name: str) -> dict | None:
        from kubernetes.client import ApiException

        try:
            return self.custom.get_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, name)
        except ApiException as err:
            if err.status == 404:
                return None
            raise

    def create(self, manifest: dict) -> dict | None:
        """Create the job; None when it already exists (409)."""
        from kubernetes.client import ApiException

        try:
            return self.custom.create_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, manifest)
        except ApiException as err:
            if err.status == 409:
                return None
            raise

    def delete(self, name: str) -> None:
        from kubernetes.client import ApiException

        try:
            self.custom.delete_namespaced_custom_object(
                GROUP, VERSION, self.namespace, PLURAL, name, body={"propagationPolicy": "Foreground"})
        except ApiException as err:
            if err.status != 404:
                raise

    def pods(self, name: str) -> list[dict]:
        resp = self.core.list_namespaced_pod(self.namespace, label_selector=f"{JOB_LABEL}={name}",
                                             _preload_content=False)
        items = json.loads(resp.data).get("items") or []
        return [p for p in items if (p.get("metadata", {}).get("labels") or {}).get(JOB_LABEL) == name]

    def watch(self, name: str, read_timeout: float):
        """Yield ``(event type, job)`` for this job until the server or ``read_timeout`` ends the stream.

        ``watch`` goes as the string "true": kubernetes' own Watch sends Python's ``True``, which only
        the real API server forgives.
        """
        from kubernetes.watch.watch import iter_resp_lines

        resp = self.custom.list_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, watch="true", field_selector=f"metadata.name={name}",
            timeout_seconds=max(1, int(read_timeout)), _preload_content=False,
            _request_timeout=(10, read_timeout + 2))
        try:
            for line in iter_resp_lines(resp):
                event = json.loads(line)
                obj = event.get("object") or {}
                if event.get("type") == "ERROR":
                    return
                if obj.get("metadata", {}).get("name") == name:
                    yield event["type"], obj
        finally:
            resp.release_conn()

    def follow_log(self, pod: str, emit: Callable[[str], None]) -> None:
        resp = self.core.read_namespaced_pod_log(pod, self.namespace, container="pytorch", follow=True,
                                                 _preload_content=False)
        try:
            for raw in resp.stream(4096):
                for line in raw.decode(errors="replace").splitlines():
                    emit(line)
        finally:
            resp.release_conn()


def _say(message: str) -> None:
    print(f"launch[kubernetes]: {message}", file=sys.stderr, flush=True)


class Launcher:
    """Create-or-adopt, wait, map: one instance per launch attempt."""

    def __init__(self, jobs: JobClient, *, timeout_seconds: float, say: Callable[[str], None] = _say,
                 poll_seconds: float = 1.0) -> None:
        self.jobs = jobs
        self.timeout_seconds = timeout_seconds
        self.say = say
        self.poll_seconds = poll_seconds
        self._log_thread: threading.Thread | None = None

    def run(self, manifest: dict, rebuild: Callable[[], dict]) -> LaunchResult:
        """Drive the job named in ``manifest`` to its end. ``rebuild`` makes the manifest of a
        recreated job (no stale ``resume_from``: training resumes from the latest checkpoint)."""
        name = manifest["metadata"]["name"]
        started = time.monotonic()
        job = self.jobs.get(name)
        recreated = False
        if job is not None:
            state = job_state(job)
            self.say(f"found job {name} from an earlier attempt: {state.phase}")
            if state.phase == "Failed":
                code, why = failure_exit_code(job, self.jobs.pods(name))
                if code not in RETRYABLE:
                    return LaunchResult(exit_code=code, message=f"job {name} failed: {why}", job_name=name)
                self.say(f"earlier job failed with retryable {code} ({why}); deleting and creating it again")
                self._delete_and_wait(name)
                job, recreated, manifest = None, True, rebuild()
        if job is None:
            created = self.jobs.create(manifest)
            if created is None:
                self.say(f"job {name} already exists (409): adopting it")
            else:
                self.say(f"created PyTorchJob {self.jobs.namespace}/{name}")
        result = self._wait(name, deadline=started + self.timeout_seconds)
        result.duration_seconds = time.monotonic() - started
        result.job_name = name
        if recreated:
            result.message = f"recreated after a retryable failure; {result.message}"
        return result

    def _delete_and_wait(self, name: str) -> None:
        self.jobs.delete(name)
        deadline = time.monotonic() + 300
        while self.jobs.get(name) is not None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {name} still exists 300 s after delete")
            time.sleep(self.poll_seconds)

    def _wait(self, name: str, deadline: float) -> LaunchResult:
        last_summary = last_phase = None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return LaunchResult(exit_code=int(ExitCode.RETRY_ME),
                                    message=f"job {name} did not finish within {self.timeout_seconds:g} s; "
                                            "it keeps running and the next attempt adopts it")
            try:
                for kind, job in self.jobs.watch(name, read_timeout=min(remaining, 60.0)):
                    if kind == "DELETED":
                        return LaunchResult(exit_code=int(ExitCode.RETRY_ME),
                                            message=f"job {name} was deleted while launch waited")
                    state = job_state(job)
                    summary = replica_summary(job)
                    if (state.phase, summary) != (last_phase, last_summary):
                        self.say(f"{name}: {state.phase}" + (f" [{summary}]" if summary else ""))
                        last_phase, last_summary = state.phase, summary
                    if state.phase == "Running":
                        self._start_log(name)
                    if state.finished:
                        return self._ended(name, job)
                    if state.phase == "Pending":
                        blocked = unstartable_reason(self.jobs.pods(name))
                        if blocked:
                            return LaunchResult(exit_code=int(ExitCode.BAD_INPUT),
                                                message=f"job {name} cannot start: {blocked}")
            except _stream_errors() as err:
                self.say(f"watch of {name} interrupted ({type(err).__name__}); watching again")
            # The stream ended (server timeout, read timeout, dropped connection): re-read and re-watch.
            job = self.jobs.get(name)
            if job is None:
                return LaunchResult(exit_code=int(ExitCode.RETRY_ME), message=f"job {name} disappeared while launch waited")
            if job_state(job).finished:
                return self._ended(name, job)

    def _ended(self, name: str, job: dict) -> LaunchResult:
        state = job_state(job)
        if state.phase == "Succeeded":
            return LaunchResult(exit_code=0, message=f"job {name} succeeded", restarts=state.restarts)
        code, why = failure_exit_code(job, self.jobs.pods(name))
        return LaunchResult(exit_code=code, message=f"job {name} failed: {why}", restarts=state.restarts)

    def _start_log(self, name: str) -> None:
        if self._log_thread is not None:
            return

        def follow() -> None:
            try:
                self.jobs.follow_log(f"{name}-master-0", lambda line: print(f"[master] {line}", file=sys.stderr, flush=True))
            except Exception as err:  # noqa: BLE001 - the log is a courtesy; the watch decides the outcome
                reason = getattr(err, "status", None) or str(err).splitlines()[0][:200]
                self.say(f"master log unavailable: {type(err).__name__} {reason}")

        self._log_thread = threading.Thread(target=follow, name=f"log-{name}", daemon=True)
        self._log_thread.start()


def _stream_errors() -> tuple[type[BaseException], ...]:
    import urllib3

    return (urllib3.exceptions.HTTPError, TimeoutError, ConnectionError)


def launch(config: RelaunchConfig, *, pipeline_run_id: str, resume_from: str | None) -> LaunchResult:
    """Train ``config`` as a PyTorchJob and wait for it; same contract as the local backend.

    Returns a :class:`LaunchResult` whose ``exit_code`` follows the contract: 0, the job's permanent
    code, a retryable code (the step is retried and adopts or recreates the job), 2 when the API
    refuses us (401/403/422: credentials, RBAC, an invalid manifest), 138 when it is unreachable.
    """
    from kubernetes.client import ApiException

    k8s = config.launch.kubernetes

    def build(resume: str | None) -> dict:
        return build_pytorchjob(config, pipeline_run_id=pipeline_run_id, resume_from=resume, owner=owner_from_env())

    try:
        jobs = JobClient(kube_api_client(), k8s.namespace)
        return Launcher(jobs, timeout_seconds=k8s.wait_timeout_seconds).run(build(resume_from), lambda: build(None))
    except BadInput as err:
        return LaunchResult(exit_code=int(ExitCode.BAD_INPUT), message=str(err))
    except ApiException as err:
        permanent = err.status in (400, 401, 403, 404, 422)
        code = ExitCode.BAD_INPUT if permanent else ExitCode.RETRY_ME
        return LaunchResult(exit_code=int(code), message=f"Kubernetes API refused the request: {err.status} {err.reason}")
    except (*_stream_errors(), OSError) as err:  # connection refused, DNS, TLS: the cluster may come back
        return LaunchResult(exit_code=int(ExitCode.RETRY_ME), message=f"Kubernetes API unreachable: {err}")


# --------------------------------------------------------------------------- the Argo exit handler


@dataclass
class DeleteOutputs:
    job_name: str
    deleted: bool


def delete_job(config: RelaunchConfig, pipeline_run_id: str = "") -> DeleteOutputs:
    """Delete this pipeline run's PyTorchJob (the exit handler of a failed or stopped workflow).

    Raises:
        BadInput: no pipeline run id, or no Kubernetes credentials.
    """
    if not pipeline_run_id:
        raise BadInput("delete-pytorchjob: --input pipeline_run_id=ID is required")
    name = job_name(config.name, pipeline_run_id, STEP)
    jobs = JobClient(kube_api_client(), config.launch.kubernetes.namespace)
    existed = jobs.get(name) is not None
    if existed:
        jobs.delete(name)
        _say(f"deleted PyTorchJob {jobs.namespace}/{name}")
    return DeleteOutputs(job_name=name, deleted=existed)


run = delete_job  # what ``python -m components.launchers.kubernetes`` (the step CLI) runs


if __name__ == "__main__":
    from components.core.stepcli import step_main

    sys.exit(step_main("delete-pytorchjob", delete_job))
