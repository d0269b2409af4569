"""Fixtures for the Kubernetes tests: an HTTP Kubernetes API (kmock's emulator) the real
``kubernetes`` client talks to through a kubeconfig, and the shared-schema validators."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
import kmock as kmock_lib
import yaml

from components.core.config import RelaunchConfig, load_config

NAMESPACE = "relaunch-test"
JOBS = "/apis/kubeflow.org/v1/namespaces/relaunch-test/pytorchjobs"


@pytest.fixture
def cluster(kmock, tmp_path, monkeypatch):
    """kmock serving PyTorchJobs and pods, with KUBECONFIG pointing at it (what a user's laptop has)."""
    kmock.resources["kubeflow.org/v1/pytorchjobs"].kind = "PyTorchJob"
    kmock.resources["kubeflow.org/v1/pytorchjobs"].namespaced = True
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
    return Cluster(kmock, kubeconfig)


class Cluster:
    """The test plays the Training Operator: it creates pods and moves job status along."""

    def __init__(self, kmock, kubeconfig: Path) -> None:
        self.kmock = kmock
        self.kubeconfig = kubeconfig

    def jobs(self) -> list[dict]:
        return [obj.raw for (res, _ns, _name), obj in self.kmock.objects.items()
                if res.plural == "pytorchjobs" and not obj.deleted]

    def requests(self, method: str, path_prefix: str = JOBS) -> list:
        """Requests the launcher (the kubernetes client, not this test) made."""
        return [r for r in list(self.kmock) if "OpenAPI-Generator" in r.headers.get("User-Agent", "")
                and r.method == kmock_lib.method(method.upper()) and str(r.url.path).startswith(path_prefix)]

    async def wait_for(self, predicate, what: str, limit: float = 30.0) -> None:
        deadline = time.monotonic() + limit
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"gave up waiting for {what}")
            await asyncio.sleep(0.02)

    async def put_job(self, manifest: dict, status: dict | None = None) -> None:
        body = dict(manifest, status=status) if status else manifest
        async with self.kmock.post(JOBS, json=body) as resp:
            assert resp.status < 300, await resp.text()

    async def set_status(self, name: str, status: dict) -> None:
        async with self.kmock.patch(f"{JOBS}/{name}/status", json={"status": status}) as resp:
            assert resp.status < 300, await resp.text()

    async def add_pod(self, name: str, status: dict) -> None:
        job = name.rsplit("-", 2)[0]
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": name, "namespace": NAMESPACE, "labels": {"training.kubeflow.org/job-name": job}},
               "status": status}
        async with self.kmock.post(f"/api/v1/namespaces/{NAMESPACE}/pods", json=pod) as resp:
            assert resp.status < 300, await resp.text()


    async def delete_pod(self, name: str) -> None:
        async with self.kmock.delete(f"/api/v1/namespaces/{NAMESPACE}/pods/{name}") as resp:
            assert resp.status < 300, await resp.text()


def condition(kind: str, message: str = "", reason: str = "") -> dict:
    return {"type": kind, "status": "True", "reason": reason or f"PyTorchJob{kind}", "message": message}


def terminated(code: int, reason: str = "Error") -> dict:
    return {"phase": "Failed", "containerStatuses": [
        {"name": "pytorch", "state": {"terminated": {"exitCode": code, "reason": reason}}}]}


@pytest.fixture
def k8s_config() -> RelaunchConfig:
    return load_config(None, [
        "launch.backend=kubernetes", f"launch.kubernetes.namespace={NAMESPACE}",
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
