"""TrainJob progress (Kubeflow Trainer v2.2, KEP-2779): rank 0 reports ``status.trainerStatus``
(``progressPercentage``, ``estimatedRemainingSeconds``, ``metrics``, ``lastUpdatedTime``) of the TrainJob it
runs under, which ``kubectl get trainjob`` and relaunch's launcher print.

Two ways in, chosen from the environment of the pod:

- Trainer's progress server: the controller injects ``KUBEFLOW_TRAINER_SERVER_URL`` (with
  ``KUBEFLOW_TRAINER_SERVER_CA_CERT`` and ``KUBEFLOW_TRAINER_SERVER_TOKEN``, paths of the CA and the projected
  token) when its TrainJobStatus feature gate is on; relaunch POSTs ``{"trainerStatus": ...}`` there, the
  same body the ``kubeflow`` SDK's ``update_trainjob_status`` sends (that helper swallows every answer, so a
  404 could not turn reporting off; relaunch sends the same request itself). No RBAC is needed.
- Else the Kubernetes API: relaunch's ``relaunch-torch`` runtime sets ``RELAUNCH_TRAINJOB_NAME`` and
  ``RELAUNCH_TRAINJOB_NAMESPACE`` (downward API: the JobSet label, which carries the TrainJob's name, and the
  pod's namespace), and rank 0 merge-patches the ``trainjobs/status`` subresource (the
  ``relaunch-trainjob-progress`` Role in manifests/launch/trainjob grants ``patch`` on it).

Off, with one info line and no error, when the cluster does not serve it: a 404 or 403, or a status that
comes back without ``trainerStatus`` (a Trainer before v2.2 prunes the unknown field). Reports go out on a
background thread at most every :data:`INTERVAL_SECONDS` (the last step always), so a slow API server never
holds a training step. The training loop calls :func:`step_done` once per step on every rank.
"""

from __future__ import annotations

import datetime
import json
import os
import ssl
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Any

SERVER_URL_ENVS = ("KUBEFLOW_TRAINER_SERVER_URL", "KUBEFLOW_TRAINER_STATUS_URL")
SERVER_CA_ENVS = ("KUBEFLOW_TRAINER_SERVER_CA_CERT", "KUBEFLOW_TRAINER_STATUS_CA_CERT")
SERVER_TOKEN_ENVS = ("KUBEFLOW_TRAINER_SERVER_TOKEN", "KUBEFLOW_TRAINER_STATUS_TOKEN")
TRAINJOB_ENV = "RELAUNCH_TRAINJOB_NAME"
NAMESPACE_ENV = "RELAUNCH_TRAINJOB_NAMESPACE"
INTERVAL_SECONDS = 15.0
REQUEST_TIMEOUT_SECONDS = 5.0
GROUP, VERSION, PLURAL = "trainer.kubeflow.org", "v1alpha1", "trainjobs"


class NotServed(Exception):
    """The cluster does not serve TrainJob progress (404, 403, or the field is pruned)."""


def _env(names: tuple[str, ...]) -> str | None:
    return next((os.environ[n] for n in names if os.environ.get(n)), None)


def _say(line: str) -> None:
    print(f"relaunch: progress: {line}", file=sys.stderr, flush=True)


class ServerSink:
    """POST to Trainer's progress server, as the SDK helper does."""

    def __init__(self, url: str):
        self.url = url

    def send(self, trainer_status: dict[str, Any]) -> None:
        token_path, ca = _env(SERVER_TOKEN_ENVS), _env(SERVER_CA_ENVS)
        headers = {"Content-Type": "application/json"}
        if token_path and os.path.exists(token_path):
            with open(token_path) as fh:  # projected tokens rotate: read it for every report
                headers["Authorization"] = f"Bearer {fh.read().strip()}"
        context = ssl.create_default_context(cafile=ca) if ca and os.path.exists(ca) else None
        request = urllib.request.Request(self.url, data=json.dumps({"trainerStatus": trainer_status}).encode(),
                                         headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_SECONDS, context=context):
                pass
        except urllib.error.HTTPError as err:
            if err.code in (403, 404):
                raise NotServed(f"HTTP {err.code} from {self.url}") from None
            raise


class ApiSink:
    """Merge-patch the TrainJob's ``status`` subresource through the Kubernetes API."""

    def __init__(self, name: str, namespace: str):
        self.name, self.namespace = name, namespace
        self.api = None

    def send(self, trainer_status: dict[str, Any]) -> None:
        from kubernetes import client as k8s_client, config as kconfig
        from kubernetes.client.exceptions import ApiException

        if self.api is None:
            if os.environ.get("KUBERNETES_SERVICE_HOST"):  # the pod's service account
                kconfig.load_incluster_config()
            else:
                kconfig.load_kube_config(config_file=os.environ.get("KUBECONFIG") or None)
            self.api = k8s_client.CustomObjectsApi()
        try:
            answer = self.api.patch_namespaced_custom_object_status(
                GROUP, VERSION, self.namespace, PLURAL, self.name, {"status": {"trainerStatus": trainer_status}},
                _request_timeout=REQUEST_TIMEOUT_SECONDS)
        except ApiException as err:
            if err.status in (403, 404):
                raise NotServed(f"HTTP {err.status} patching {PLURAL}/{self.name}/status") from None
            raise
        if "trainerStatus" not in ((answer or {}).get("status") or {}):
            raise NotServed("the TrainJob's status has no trainerStatus field (Kubeflow Trainer before v2.2)")


def open_sink():
    """The sink this pod's environment offers, or None outside a TrainJob."""
    url = _env(SERVER_URL_ENVS)
    if url:
        return ServerSink(url)
    name = os.environ.get(TRAINJOB_ENV)
    if name:
        return ApiSink(name, os.environ.get(NAMESPACE_ENV) or _pod_namespace())
    return None


def _pod_namespace() -> str:
    try:
        with open("/var/run/secrets/kubernetes.io/serviceaccount/namespace") as fh:
            return fh.read().strip()
    except OSError:
        return "default"


def trainer_status(step: int, total_steps: int, seconds_per_step: float | None,
                   metrics: dict[str, Any]) -> dict[str, Any]:
    """The ``trainerStatus`` of ``step`` of ``total_steps`` (KEP-2779's fields; metric values as strings)."""
    status: dict[str, Any] = {
        "progressPercentage": max(0, min(100, int(100 * step / total_steps))) if total_steps else 0,
        "lastUpdatedTime": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "metrics": [{"name": k, "value": f"{v:.6g}" if isinstance(v, float) else str(v)} for k, v in metrics.items()],
    }
    if seconds_per_step is not None:
        status["estimatedRemainingSeconds"] = max(0, int(round((total_steps - step) * seconds_per_step)))
    return status


class ProgressReporter:
    """Rank 0's reporter: :meth:`step_done` records the latest status; a daemon thread sends it."""

    def __init__(self, sink, *, interval: float = INTERVAL_SECONDS):
        self.sink, self.interval = sink, interval
        self.on = True
        self.sent = 0
        self._first: tuple[int, float] | None = None  # (step, monotonic time) of this process's first step
        self._last_sent = float("-inf")
        self._pending: dict[str, Any] | None = None
        self._wake = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="relaunch-progress", daemon=True)
        self._thread.start()

    def step_done(self, step: int, total_steps: int, metrics: dict[str, Any]) -> None:
        """Record the status after ``step``; sent when the interval has passed, and always at the end."""
        if not self.on:
            return
        now = time.monotonic()
        if self._first is None:
            self._first = (step, now)
        last = step >= total_steps
        if not last and now - self._last_sent < self.interval:
            return
        done = step - self._first[0]
        per_step = (now - self._first[1]) / done if done > 0 else None
        with self._wake:
            self._pending = trainer_status(step, total_steps, per_step, metrics)
            self._last_sent = now
            self._wake.notify()
        if last:
            self.flush(REQUEST_TIMEOUT_SECONDS * 2)

    def flush(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the recorded status to be sent."""
        deadline = time.monotonic() + timeout
        with self._wake:
            while self._pending is not None and self.on and time.monotonic() < deadline:
                self._wake.wait(0.05)

    def _run(self) -> None:
        while self.on:
            with self._wake:
                while self._pending is None:
                    self._wake.wait()
                status = self._pending
            try:
                self.sink.send(status)
                self.sent += 1
            except NotServed as err:
                _say(f"the cluster does not serve TrainJob progress ({err}); not reported")
                self.on = False
            except Exception as err:  # noqa: BLE001 - the API server is away: the next report tries again
                _say(f"not reported: {type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}")
            with self._wake:
                if self._pending is status:
                    self._pending = None
                self._wake.notify_all()


_reporter: ProgressReporter | None = None
_opened = False


def step_done(step: int, total_steps: int, *, rank: int, **metrics: Any) -> None:
    """The training loop's one call per step: on rank 0 under a TrainJob, report progress; else nothing."""
    global _reporter, _opened
    if rank != 0:
        return
    if not _opened:
        _opened = True
        sink = open_sink()
        _reporter = ProgressReporter(sink) if sink is not None else None
    if _reporter is not None:
        _reporter.step_done(step, total_steps, metrics)
