"""The launcher contract both cluster backends share: one training job per pipeline run, adopted on retry.

    relaunch render pytorchjob|trainjob -o job.yaml         # what would be created, for review
    python -m components.launch --config-json '...' --set launch.backend=trainjob \
        --input pipeline_run_id=$WORKFLOW_UID --input resume_from=s3://...
    python -m components.launchers.cluster --config-json '...' --input pipeline_run_id=ID   # the exit handler

A backend (:mod:`~components.launchers.pytorchjob`, :mod:`~components.launchers.trainjob`) is a
:class:`JobKind`: its resource, how to read its state, how to find its pods, and a pure builder.
Everything else is here, written once: the :class:`Launcher` creates or adopts the job, waits on a
watch, streams node 0's log, and maps how the job ended to the exit-code contract.

=========================  ===================================================================
job found                  what launch does
=========================  ===================================================================
none                       create it (a 409 on create means another attempt won: adopt it)
running / pending          adopt it and keep waiting
suspended (e.g. Kueue)     keep waiting: a queued job is not a failure; at the wait timeout 138
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
from components.core.errors import BadInput, TransientFailure
from components.core.exitcodes import PERMANENT, RETRYABLE, ExitCode, normalize
from components.core.k8s_naming import job_name, run_hash
from components.launchers import LaunchResult, backend_module

RUN_LABEL = "relaunch.dev/pipeline-run"
RUN_ANNOTATION = "relaunch.dev/pipeline-run-id"
STEP = "launch"
# After a delete, how long to wait for the job (and its Foreground-deleted pods) to be gone before
# recreating it under the same name; a finalizer stuck longer than this needs a human.
DELETE_WAIT_SECONDS = 300.0
# One watch request's read timeout; the stream is re-opened after it, so this bounds reaction time
# to a dropped connection, not the wait.
WATCH_SECONDS = 60.0

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

# Pod-level reasons (status.reason) meaning "the pod was taken away", not "the program failed".
PREEMPTION_REASONS = frozenset({"Evicted", "Preempting", "NodeLost", "NodeShutdown", "Shutdown",
                                "Terminated", "DeletionByTaintManager", "DeletionByPodGC", "UnexpectedAdmissionError"})
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
    """Every ended pod or training container of a job as ``(exit code of the contract, why)``.

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
            if cs.get("name") not in (None, container):
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
    """The few job and pod calls the launcher makes, on one namespace: exactly what the backend's
    Role in ``manifests/`` grants (create/get/list/watch/delete on the job; get/list on pods and logs)."""

    def __init__(self, api_client, kind: JobKind, namespace: str) -> None:
        from kubernetes import client

        self.custom = client.CustomObjectsApi(api_client)
        self.core = client.CoreV1Api(api_client)
        self.kind = kind
        self.namespace = namespace

    def _resource(self) -> tuple[str, str, str, str]:
        return self.kind.group, self.kind.version, self.namespace, self.kind.plural

    def get(self, name: str) -> dict | None:
        from kubernetes.client import ApiException

        try:
            return self.custom.get_namespaced_custom_object(*self._resource(), name)
        except ApiException as err:
            if err.status == 404:
                return None
            raise

    def create(self, manifest: dict) -> dict | None:
        """Create the job; None when it already exists (409)."""
        from kubernetes.client import ApiException

        try:
            return self.custom.create_namespaced_custom_object(*self._resource(), manifest)
        except ApiException as err:
            if err.status == 409:
                return None
            raise

    def delete(self, name: str) -> None:
        from kubernetes.client import ApiException

        try:
            self.custom.delete_namespaced_custom_object(*self._resource(), name, body={"propagationPolicy": "Foreground"})
        except ApiException as err:
            if err.status != 404:
                raise

    def pods(self, name: str) -> list[dict]:
        selector = self.kind.pod_selector(name)
        resp = self.core.list_namespaced_pod(self.namespace, label_selector=selector, _preload_content=False)
        items = json.loads(resp.data).get("items") or []
        key, _, value = selector.partition("=")
        return [p for p in items if (p.get("metadata", {}).get("labels") or {}).get(key) == value]

    def watch(self, name: str, read_timeout: float):
        """Yield ``(event type, job)`` for this job until the server or ``read_timeout`` ends the stream.

        ``watch`` goes as the string "true": kubernetes' own Watch sends Python's ``True``, which only
        the real API server forgives.
        """
        from kubernetes.watch.watch import iter_resp_lines

        resp = self.custom.list_namespaced_custom_object(
            *self._resource(), watch="true", field_selector=f"metadata.name={name}",
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
        resp = self.core.read_namespaced_pod_log(pod, self.namespace, container=self.kind.container, follow=True,
                                                 _preload_content=False)
        try:
            for raw in resp.stream(4096):
                for line in raw.decode(errors="replace").splitlines():
                    emit(line)
        finally:
            resp.release_conn()


class Launcher:
    """Create-or-adopt, wait, map: one instance per launch attempt, for either backend."""

    def __init__(self, jobs: JobClient, *, timeout_seconds: float, say: Callable[[str], None] | None = None,
                 poll_seconds: float = 1.0) -> None:
        self.jobs = jobs
        self.kind = jobs.kind
        self.timeout_seconds = timeout_seconds
        self.say = say or (lambda message: print(f"launch[{self.kind.plural}]: {message}", file=sys.stderr, flush=True))
        self.poll_seconds = poll_seconds
        self._log_thread: threading.Thread | None = None
        self._last: JobState | None = None

    def run(self, manifest: dict, rebuild: Callable[[], dict]) -> LaunchResult:
        """Drive the job named in ``manifest`` to its end. ``rebuild`` makes the manifest of a
        recreated job (no stale ``resume_from``: training resumes from the latest checkpoint)."""
        name = manifest["metadata"]["name"]
        started = time.monotonic()
        job = self.jobs.get(name)
        recreated = False
        if job is not None:
            state = self.kind.state(job)
            self.say(f"found {self.kind.kind} {name} from an earlier attempt: {state.phase}")
            if state.phase == "Failed":
                code, why = failure_exit_code(self.kind, job, self.jobs.pods(name))
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
                self.say(f"created {self.kind.kind} {self.jobs.namespace}/{name}")
        result = self._wait(name, deadline=started + self.timeout_seconds)
        result.duration_seconds = time.monotonic() - started
        result.job_name = name
        if recreated:
            result.message = f"recreated after a retryable failure; {result.message}"
        return result

    def _delete_and_wait(self, name: str) -> None:
        self.jobs.delete(name)
        deadline = time.monotonic() + DELETE_WAIT_SECONDS
        while self.jobs.get(name) is not None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {name} still exists {DELETE_WAIT_SECONDS:g} s after delete")
            time.sleep(self.poll_seconds)

    def _wait(self, name: str, deadline: float) -> LaunchResult:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return self._timed_out(name)
            try:
                for event, job in self.jobs.watch(name, read_timeout=min(remaining, WATCH_SECONDS)):
                    if event == "DELETED":
                        return LaunchResult(exit_code=int(ExitCode.RETRY_ME),
                                            message=f"job {name} was deleted while launch waited")
                    ended = self._observe(name, job)
                    if ended is not None:
                        return ended
            except _stream_errors() as err:
                self.say(f"watch of {name} interrupted ({type(err).__name__}); watching again")
            # The stream ended (server timeout, read timeout, dropped connection): re-read and re-watch.
            job = self.jobs.get(name)
            if job is None:
                return LaunchResult(exit_code=int(ExitCode.RETRY_ME), message=f"job {name} disappeared while launch waited")
            if self.kind.state(job).finished:
                return self._ended(name, job)

    def _observe(self, name: str, job: dict) -> LaunchResult | None:
        """Report a change of state; return the result once the job has ended or can never start."""
        state = self.kind.state(job)
        summary = self.kind.summary(job)
        last = self._last
        if last is None or (state.phase, state.progress) != (last.phase, last.progress):
            self.say(f"{name}: {state.phase}" + (f" [{summary}]" if summary else "")
                     + (f" {state.progress}" if state.progress else ""))
        self._last = state
        if state.phase == "Running":
            self._start_log(name)
        if state.finished:
            return self._ended(name, job)
        if state.phase == "Pending":
            blocked = unstartable_reason(self.jobs.pods(name))
            if blocked:
                return LaunchResult(exit_code=int(ExitCode.BAD_INPUT), message=f"job {name} cannot start: {blocked}")
        return None

    def _timed_out(self, name: str) -> LaunchResult:
        """Out of time: 138 and the job is left as it is, so the next attempt adopts it."""
        phase = self._last.phase if self._last else "Pending"
        if phase == "Suspended":
            why = "it stayed Suspended (not admitted, e.g. queued by Kueue)"
        else:
            why = unscheduled_reason(self.jobs.pods(name)) or f"it was {phase}"
        return LaunchResult(exit_code=int(ExitCode.RETRY_ME),
                            message=f"job {name} did not finish within {self.timeout_seconds:g} s: {why}; "
                                    "it is left in place and the next attempt adopts it")

    def _ended(self, name: str, job: dict) -> LaunchResult:
        state = self.kind.state(job)
        if state.phase == "Succeeded":
            return LaunchResult(exit_code=0, message=f"job {name} succeeded", restarts=state.restarts)
        code, why = failure_exit_code(self.kind, job, self.jobs.pods(name))
        return LaunchResult(exit_code=code, message=f"job {name} failed: {why}", restarts=state.restarts)

    def _start_log(self, name: str) -> None:
        if self._log_thread is not None:
            return

        def follow() -> None:
            try:
                node0 = next((p["metadata"]["name"] for p in self.jobs.pods(name) if self.kind.is_node0(p)), None)
                if node0 is None:
                    self.say("node-0 pod not found; no log to follow")
                    return
                self.jobs.follow_log(node0, lambda line: print(f"[node0] {line}", file=sys.stderr, flush=True))
            except Exception as err:  # noqa: BLE001 - the log is a courtesy; the watch decides the outcome
                reason = getattr(err, "status", None) or str(err).splitlines()[0][:200]
                self.say(f"node-0 log unavailable: {type(err).__name__} {reason}")

        self._log_thread = threading.Thread(target=follow, name=f"log-{name}", daemon=True)
        self._log_thread.start()


def _stream_errors() -> tuple[type[BaseException], ...]:
    import urllib3

    return (urllib3.exceptions.HTTPError, TimeoutError, ConnectionError)


def launch_job(kind: JobKind, build: Callable[[str | None], dict], config: RelaunchConfig,
               resume_from: str | None) -> LaunchResult:
    """Create or adopt the job ``build(resume_from)`` describes and wait for it; the contract of
    every backend.

    Returns a :class:`LaunchResult` whose ``exit_code`` follows the contract: 0, the job's permanent
    code, a retryable code (the step is retried and adopts or recreates the job), 2 when the API
    refuses us (401/403/422: credentials, RBAC, an invalid manifest), 138 when it is unreachable.
    """
    from kubernetes.client import ApiException

    k8s = config.launch.kubernetes
    try:
        jobs = JobClient(kube_api_client(), kind, k8s.namespace)
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
    """Delete this pipeline run's training job (the exit handler of a failed or stopped workflow).

    Deleting a job that is already gone succeeds, so the handler can be retried safely.

    Raises:
        BadInput: no pipeline run id, or no Kubernetes credentials.
    """
    if not pipeline_run_id:
        raise BadInput("delete-training-job: --input pipeline_run_id=ID is required")
    name = job_name(config.name, pipeline_run_id, STEP)
    if not config.launch.on_cluster:
        return DeleteOutputs(job_name=name, deleted=False)
    from kubernetes.client import ApiException

    kind = backend_module(config).KIND
    jobs = JobClient(kube_api_client(), kind, config.launch.kubernetes.namespace)
    try:
        existed = jobs.get(name) is not None
        if existed:
            jobs.delete(name)
            print(f"delete-training-job: deleted {kind.kind} {jobs.namespace}/{name}", file=sys.stderr)
    except ApiException as err:
        if err.status in (400, 401, 403, 422):
            raise BadInput(f"Kubernetes API refused deleting {kind.kind} {name}: {err.status} {err.reason}") from None
        raise TransientFailure(f"deleting {kind.kind} {name}: {err.status} {err.reason}") from None
    except (*_stream_errors(), OSError) as err:
        raise TransientFailure(f"Kubernetes API unreachable while deleting {kind.kind} {name}: {err}") from None
    return DeleteOutputs(job_name=name, deleted=existed)


run = delete_job  # what ``python -m components.launchers.cluster`` (the step CLI) runs


if __name__ == "__main__":
    from components.core.stepcli import step_main

    sys.exit(step_main("delete-training-job", delete_job))
