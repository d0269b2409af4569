"""Fixtures for the Kubernetes tests: an HTTP Kubernetes API (kmock's emulator) the real
``kubernetes`` client talks to through a kubeconfig, and the shared-schema validators."""

from __future__ import annotations

import asyncio
import importlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import kmock as kmock_lib
import yaml

from relaunch.components.core.contract.config import RelaunchConfig
from relaunch.components.core.contract.config_loading import load_config

NAMESPACE = "relaunch-test"
BACKENDS = ("pytorchjob", "trainjob")


@dataclass(frozen=True)
class Operator:
    """What the test plays for one backend: the resource path, the pods and the status the operator
    (Training Operator or Trainer + JobSet) would write."""

    backend: str
    group_version: str
    plural: str
    kind: str
    container: str

    @property
    def jobs_path(self) -> str:
        return f"/apis/{self.group_version}/namespaces/{NAMESPACE}/{self.plural}"

    def node0_pod(self, job: str) -> tuple[str, dict[str, str]]:
        if self.backend == "pytorchjob":
            return f"{job}-master-0", {"training.kubeflow.org/job-name": job}
        return f"{job}-node-0-0-x7k2p", {"jobset.sigs.k8s.io/jobset-name": job, "jobset.sigs.k8s.io/job-index": "0",
                                         "batch.kubernetes.io/job-completion-index": "0"}

    def running(self) -> dict:
        if self.backend == "pytorchjob":
            return {"conditions": [condition("Created"), condition("Running")], "replicaStatuses": {"Master": {"active": 1}}}
        return {"jobsStatus": [{"name": "node", "active": 1, "ready": 1, "succeeded": 0, "failed": 0, "suspended": 0}]}

    def succeeded(self) -> dict:
        return {"conditions": [condition("Running" if self.backend == "pytorchjob" else "Created"),
                               condition("Succeeded" if self.backend == "pytorchjob" else "Complete")]}

    def failed(self, message: str = "") -> dict:
        return {"conditions": [condition("Failed", message or "the job failed")]}

    def suspended(self) -> dict:
        return {"conditions": [condition("Suspended", f"{self.kind} is suspended", reason="Suspended")]}

    def terminated(self, code: int, reason: str = "Error") -> dict:
        return terminated(code, reason, container=self.container)

    def build(self, config, **kwargs) -> dict:
        module = importlib.import_module(f"relaunch.components.launchers.{self.backend}")
        return getattr(module, f"build_{self.backend}")(config, **kwargs)


OPERATORS = {
    "pytorchjob": Operator("pytorchjob", "kubeflow.org/v1", "pytorchjobs", "PyTorchJob", "pytorch"),
    "trainjob": Operator("trainjob", "trainer.kubeflow.org/v1alpha1", "trainjobs", "TrainJob", "node"),
}


@pytest.fixture
def backend() -> str:
    """The launch backend a test runs against; parametrize ``backend`` to run it for both."""
    return "pytorchjob"


@pytest.fixture
def cluster(kmock, tmp_path, monkeypatch, backend):
    """kmock serving both job kinds and pods, with KUBECONFIG pointing at it (what a user's laptop has)."""
    for op in OPERATORS.values():
        kmock.resources[f"{op.group_version}/{op.plural}"].kind = op.kind
        kmock.resources[f"{op.group_version}/{op.plural}"].namespaced = True
    return Cluster(kmock, kubeconfig_of(kmock, tmp_path, monkeypatch), OPERATORS[backend])


def kubeconfig_of(kmock, tmp_path, monkeypatch) -> Path:
    """Serve pods from kmock and point KUBECONFIG at it (what a user's laptop has); the file's path."""
    kmock.resources["v1/pods"].kind = "Pod"
    kmock.resources["v1/pods"].namespaced = True
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
        "clusters": [{"name": "kmock", "cluster": {"server": str(kmock.url).rstrip("/")}}],
        "users": [{"name": "kmock", "user": {"token": "not-a-secret"}}],
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock", "namespace": NAMESPACE}}],
    }))
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    return kubeconfig


class Cluster:
    """The test plays the operator: it creates pods and moves job status along."""

    def __init__(self, kmock, kubeconfig: Path, operator: Operator) -> None:
        self.kmock = kmock
        self.kubeconfig = kubeconfig
        self.op = operator

    def jobs(self) -> list[dict]:
        return [obj.raw for (res, _ns, _name), obj in self.kmock.objects.items()
                if res.plural == self.op.plural and not obj.deleted]

    def requests(self, method: str | None, path_prefix: str | None = None) -> list:
        """Requests the launcher (the kubernetes client, not this test) made; ``method`` None: any."""
        prefix = self.op.jobs_path if path_prefix is None else path_prefix
        return [r for r in list(self.kmock) if "OpenAPI-Generator" in r.headers.get("User-Agent", "")
                and (method is None or r.method == kmock_lib.method(method.upper()))
                and str(r.url.path).startswith(prefix)]

    def log_requested(self) -> bool:
        return bool(self.requests("GET", f"/api/v1/namespaces/{NAMESPACE}/pods/"))

    def watching(self) -> int:
        return sum(r.params.get("watch") == "true" for r in self.requests("GET"))

    async def wait_for(self, predicate, what: str, limit: float = 30.0) -> None:
        deadline = time.monotonic() + limit
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"gave up waiting for {what}")
            await asyncio.sleep(0.02)

    async def put_job(self, manifest: dict, status: dict | None = None) -> None:
        body = dict(manifest, status=status) if status else manifest
        async with self.kmock.post(self.op.jobs_path, json=body) as resp:
            assert resp.status < 300, await resp.text()

    async def set_status(self, name: str, status: dict) -> None:
        async with self.kmock.patch(f"{self.op.jobs_path}/{name}/status", json={"status": status}) as resp:
            assert resp.status < 300, await resp.text()

    async def settle(self, name: str, status: dict, seen, what: str, limit: float = 30.0) -> None:
        """Set the job's status, and set it again each second until ``seen()``, as an operator's resync does.

        kmock 0.8 streams a new watch's existing objects first and subscribes it to later changes only
        after that (``_serve_watch``), so a change landing in between is never sent; a real API server
        watches on from the state it listed. Once is enough there; here, repeating it closes the gap.
        """
        deadline = time.monotonic() + limit
        while True:
            await self.set_status(name, status)
            for _ in range(50):
                if seen():
                    return
                await asyncio.sleep(0.02)
            if time.monotonic() > deadline:
                raise AssertionError(f"gave up waiting for {what}")

    async def finish(self, task: asyncio.Task, name: str, status: dict):
        """Move the job to the status that ends it and return the launcher's result (``task``'s)."""
        await self.settle(name, status, task.done, "the launcher to see the job end")
        return await task

    async def add_pod(self, name: str, status: dict, labels: dict[str, str] | None = None) -> None:
        """A pod of a job; ``name`` is the job's name and ``labels`` None: the node-0 pod of that job."""
        if labels is None:
            name, labels = self.op.node0_pod(name)
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": name, "namespace": NAMESPACE, "labels": labels}, "status": status}
        async with self.kmock.post(f"/api/v1/namespaces/{NAMESPACE}/pods", json=pod) as resp:
            assert resp.status < 300, await resp.text()

    async def delete_node0_pod(self, job: str) -> None:
        async with self.kmock.delete(f"/api/v1/namespaces/{NAMESPACE}/pods/{self.op.node0_pod(job)[0]}") as resp:
            assert resp.status < 300, await resp.text()


def condition(kind: str, message: str = "", reason: str = "") -> dict:
    return {"type": kind, "status": "True", "reason": reason or f"PyTorchJob{kind}", "message": message}


def terminated(code: int, reason: str = "Error", container: str = "pytorch") -> dict:
    return {"phase": "Failed", "containerStatuses": [
        {"name": container, "state": {"terminated": {"exitCode": code, "reason": reason}}}]}


@pytest.fixture
def k8s_config(backend) -> RelaunchConfig:
    return load_config(None, [
        f"launch.backend={backend}", f"launch.kubernetes.namespace={NAMESPACE}",
        "launch.kubernetes.wait_timeout_seconds=60", "store.uri=s3://relaunch-test/store",
        "tracking.uri=http://mlflow.relaunch.svc:5000",
    ])


# --------------------------------------------------------------------------- schemas (loaded once)


@pytest.fixture(scope="session")
def argo_definitions(schemas_dir) -> dict:
    schema = json.loads((schemas_dir / "argo-workflows" / "schema.json").read_text())
    return schema["definitions"]


@pytest.fixture(scope="session")
def crd_schema(schemas_dir):
    """``crd_schema(path, version)`` -> the openAPIV3Schema of that CRD version, parsed once."""
    cache: dict[tuple[str, str], dict] = {}

    def get(relpath: str, version: str = "v1alpha1") -> dict:
        key = (relpath, version)
        if key not in cache:
            loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
            crd = yaml.load((schemas_dir / relpath).read_text(), Loader=loader)
            cache[key] = next(v for v in crd["spec"]["versions"] if v["name"] == version)["schema"]["openAPIV3Schema"]
        return cache[key]

    return get
