"""The launcher contract both cluster backends share: one training job per pipeline run, adopted on retry.

    relaunch render pytorchjob|trainjob -o job.yaml         # what would be created, for review
    python -m relaunch.components.launch --config-json '...' --set launch.backend=trainjob \
        --input pipeline_run_id=$WORKFLOW_UID --input resume_from=s3://...
    python -m relaunch.components.launchers.cluster --config-json '...' --input pipeline_run_id=ID   # the exit handler

A backend (:mod:`~relaunch.components.launchers.pytorchjob`, :mod:`~relaunch.components.launchers.trainjob`) is a
:class:`~relaunch.components.launchers.jobs.JobKind` (its resource, how to read its state, how to find its
pods) and a pure builder made of :mod:`relaunch.components.launchers.jobs`. The acting part is here, once: the :class:`Launcher` creates or adopts the job, waits on a
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
from typing import Callable

from ..core.contract.classify import classify
from ..core.contract.steps import DELETE_JOB
from ..core.contract.config import RelaunchConfig
from ..core.contract.errors import BadInput, TransientFailure
from ..core.contract.exitcodes import RETRYABLE, ExitCode
from .k8s_naming import job_name, run_hash
from . import LaunchResult, backend_module
from .jobs import (RUN_LABEL, STEP, JobKind, JobState, failure_exit_code, unscheduled_reason,
                   unstartable_reason)

# After a delete, how long to wait for the job (and its Foreground-deleted pods) to be gone before
# recreating it under the same name; a finalizer stuck longer than this needs a human.
DELETE_WAIT_SECONDS = 300.0
# One watch request's read timeout; the stream is re-opened after it, so this bounds reaction time
# to a dropped connection, not the wait.
WATCH_SECONDS = 60.0


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

    def of_run(self, pipeline_run_id: str) -> list[str]:
        """The names of this kind's jobs labelled with pipeline run ``pipeline_run_id`` (:data:`RUN_LABEL`:
        its training job, a study's trial jobs), by name."""
        value = run_hash(pipeline_run_id)
        found = self.custom.list_namespaced_custom_object(*self._resource(), label_selector=f"{RUN_LABEL}={value}")
        return sorted(job["metadata"]["name"] for job in found.get("items") or []
                      if (job["metadata"].get("labels") or {}).get(RUN_LABEL) == value)

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
                 poll_seconds: float = 1.0,
                 failure: Callable[[dict, list[dict]], tuple[int, str]] | None = None) -> None:
        self.jobs = jobs
        self.kind = jobs.kind
        # how a failed job maps to the contract (default: its pods' codes; a RayJob reads the training's record)
        self.failure = failure or (lambda job, pods: failure_exit_code(self.kind, job, pods))
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
                code, why = self.failure(job, self.jobs.pods(name))
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
        code, why = self.failure(job, self.jobs.pods(name))
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
               resume_from: str | None,
               failure: Callable[[dict, list[dict]], tuple[int, str]] | None = None) -> LaunchResult:
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
        return Launcher(jobs, timeout_seconds=k8s.wait_timeout_seconds, failure=failure).run(
            build(resume_from), lambda: build(None))
    except BadInput as err:
        return LaunchResult(exit_code=int(ExitCode.BAD_INPUT), message=str(err))
    except ApiException as err:
        return LaunchResult(exit_code=int(classify(err)),
                            message=f"Kubernetes API refused the request: {err.status} {err.reason}")
    except (*_stream_errors(), OSError) as err:  # connection refused, DNS, TLS: the cluster may come back
        return LaunchResult(exit_code=int(ExitCode.RETRY_ME), message=f"Kubernetes API unreachable: {err}")


# --------------------------------------------------------------------------- the Argo exit handler


@dataclass
class DeleteOutputs:
    job_name: str
    deleted: bool


def delete_job(config: RelaunchConfig, pipeline_run_id: str = "") -> DeleteOutputs:
    """Delete this pipeline run's training jobs (the exit handler of a failed or stopped workflow): its
    launch step's job and every job labelled with the run (a study's trial jobs). ``job_name`` is the
    launch step's job's name, ``deleted`` whether any job was.

    Deleting a job that is already gone succeeds, so the handler can be retried safely.

    Raises:
        BadInput: no pipeline run id, or no Kubernetes credentials.
    """
    if not pipeline_run_id:
        raise BadInput(f"{DELETE_JOB}: --input pipeline_run_id=ID is required")
    name = job_name(config.name, pipeline_run_id, STEP)
    if not config.launch.on_cluster:
        return DeleteOutputs(job_name=name, deleted=False)
    from kubernetes.client import ApiException

    kind = backend_module(config).KIND
    jobs = JobClient(kube_api_client(), kind, config.launch.kubernetes.namespace)
    try:
        found = sorted({*jobs.of_run(pipeline_run_id), *([name] if jobs.get(name) is not None else [])})
        for each in found:
            jobs.delete(each)
            print(f"{DELETE_JOB}: deleted {kind.kind} {jobs.namespace}/{each}", file=sys.stderr)
    except ApiException as err:
        if err.status in (400, 401, 403, 422):
            raise BadInput(f"Kubernetes API refused deleting the {kind.kind}s of run {pipeline_run_id}: "
                           f"{err.status} {err.reason}") from None
        raise TransientFailure(f"deleting the {kind.kind}s of run {pipeline_run_id}: {err.status} {err.reason}") from None
    except (*_stream_errors(), OSError) as err:
        raise TransientFailure(f"Kubernetes API unreachable while deleting the {kind.kind}s of run {pipeline_run_id}: "
                               f"{err}") from None
    return DeleteOutputs(job_name=name, deleted=bool(found))


run = delete_job  # what ``python -m relaunch.components.launchers.cluster`` (the step CLI) runs


if __name__ == "__main__":
    from ..core.runtime.stepcli import step_main

    sys.exit(step_main(DELETE_JOB, delete_job))
