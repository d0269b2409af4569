"""The KubeRay RayJob the ``rayjob`` backend creates: valid against the KubeRay v1.7.0 CRD, named from the pipeline
run, and driven through the launcher contract (adopt or create, watch, map, delete) against an HTTP Kubernetes API
(kmock's emulator) through the real ``kubernetes`` client, the test playing the KubeRay operator."""

from __future__ import annotations

import asyncio
import json
import shlex

import pytest
import yaml
from jsonschema import Draft7Validator

from relaunch.components.core.contract.config_loading import load_config
from relaunch.components.core.contract.exitcodes import ExitCode
from relaunch.components.core.store import open_store
from relaunch.components.core.store.records import write_exit_record
from relaunch.components.launchers import renderers
from relaunch.components.launchers.jobs import job_spec
from relaunch.components.launchers.rayjob import build_rayjob, job_state
from tests.k8s.conftest import NAMESPACE, Cluster, Operator, kubeconfig_of
from tests.k8s.test_launcher_contract import ROOT, api_call

RUN_ID = "9f3c2a1e-0000-4000-8000-00000000abcd"
CRD = "kuberay/ray.io_rayjobs.yaml"
OWNER = {"apiVersion": "argoproj.io/v1alpha1", "kind": "Workflow", "name": "relaunch-x7k2p", "uid": "5b0c-uid"}
VARIANTS = {
    "defaults": [],
    "gpus, selector, tolerations, deadline": [
        "launch.nodes=4", "launch.procs_per_node=8", "launch.kubernetes.gpus_per_node=8",
        "launch.kubernetes.node_selector={pool: a100}",
        "launch.kubernetes.tolerations=[{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}]",
        "launch.kubernetes.active_deadline_seconds=7200"],
    "one node": ["launch.nodes=1", "launch.kubernetes.tracking_secret=null"],
}
RAYJOB = Operator("rayjob", "ray.io/v1", "rayjobs", "RayJob", "ray-head")


@pytest.mark.schemas
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_rendered_rayjob_validates_against_the_kuberay_crd(variant, crd_schema):
    job = build_rayjob(load_config(None, ["launch.backend=rayjob", *VARIANTS[variant]]), pipeline_run_id="uid-1",
                       resume_from="s3://b/ck", owner=OWNER)
    assert (job["apiVersion"], job["kind"]) == ("ray.io/v1", "RayJob")
    errors = list(Draft7Validator(crd_schema(CRD, "v1")).iter_errors(job))
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors[:5])


@pytest.mark.schemas
def test_the_kuberay_crd_check_can_fail(crd_schema):
    job = build_rayjob(load_config(None, ["launch.backend=rayjob"]), pipeline_run_id="uid-1")
    job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["replicas"] = "one"
    assert list(Draft7Validator(crd_schema(CRD, "v1")).iter_errors(job))


def test_head_and_workers_are_the_job_specs_nodes_with_its_gpus_selector_tolerations_and_secrets():
    config = load_config(None, ["launch.backend=rayjob", *VARIANTS["gpus, selector, tolerations, deadline"]])
    job = build_rayjob(config, pipeline_run_id="uid-1")
    spec, cluster = job["spec"], job["spec"]["rayClusterSpec"]
    (workers,) = cluster["workerGroupSpecs"]
    assert workers["replicas"] == workers["minReplicas"] == workers["maxReplicas"] == 3
    assert cluster["authOptions"] == {"mode": "token"}
    for group in (cluster["headGroupSpec"], workers):
        assert group["rayStartParams"]["num-gpus"] == "8" and group["rayStartParams"]["num-cpus"] == "8"
        pod = group["template"]["spec"]
        (container,) = pod["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"
        assert container["image"] == config.launch.kubernetes.image
        assert pod["nodeSelector"] == {"pool": "a100"} and pod["tolerations"][0]["key"] == "nvidia.com/gpu"
        refs = {e["name"]: e["valueFrom"]["secretKeyRef"]["name"] for e in container["env"] if "valueFrom" in e}
        assert refs["AWS_SECRET_ACCESS_KEY"] == "relaunch-store"
        assert not any("secret" in str(e.get("value", "")).lower() for e in container["env"])
    assert (spec["shutdownAfterJobFinishes"], spec["activeDeadlineSeconds"], spec["backoffLimit"],
            spec["ttlSecondsAfterFinished"]) == (True, 7200, 6, 86400)
    assert "workerGroupSpecs" not in build_rayjob(load_config(None, ["launch.backend=rayjob", "launch.nodes=1"]),
                                                  pipeline_run_id="uid-1")["spec"]["rayClusterSpec"]


def test_the_entrypoint_is_the_ray_backends_driver_with_the_workers_configuration():
    config = load_config(None, ["launch.backend=rayjob"])
    job = build_rayjob(config, pipeline_run_id="uid-1", resume_from="s3://b/ck")
    words = shlex.split(job["spec"]["entrypoint"])
    assert words[:5] == ["python", "-u", "-m", "relaunch.components.launchers.ray", "drive"]
    worker = json.loads(words[words.index("--config-json") + 1])
    assert worker["train"]["resume_from"] == "s3://b/ck"
    assert words[words.index("--config-json") + 1] == job_spec(config, resume_from="s3://b/ck").config_json


def test_the_name_is_stable_per_run_so_a_retried_launch_adopts_its_rayjob():
    config = load_config(None, ["launch.backend=rayjob"])
    first, again = (build_rayjob(config, pipeline_run_id=RUN_ID)["metadata"]["name"] for _ in range(2))
    other = build_rayjob(config, pipeline_run_id="another-run")["metadata"]["name"]
    assert first == again != other


def test_relaunch_render_offers_rayjob():
    job = renderers()["rayjob"](load_config(None, ["launch.backend=rayjob"]), "uid-1")
    assert job["kind"] == "RayJob"


@pytest.mark.parametrize("status, phase", [
    ({}, "Pending"),
    ({"jobDeploymentStatus": "Initializing"}, "Pending"),
    ({"jobDeploymentStatus": "Running", "jobStatus": "RUNNING"}, "Running"),
    ({"jobDeploymentStatus": "Retrying"}, "Running"),
    ({"jobDeploymentStatus": "Suspended"}, "Suspended"),
    ({"jobDeploymentStatus": "Complete", "jobStatus": "SUCCEEDED"}, "Succeeded"),
    ({"jobDeploymentStatus": "Complete", "jobStatus": "STOPPED"}, "Failed"),
    ({"jobDeploymentStatus": "Failed", "jobStatus": "FAILED"}, "Failed"),
])
def test_job_deployment_status_and_job_status_map_to_the_phases(status, phase):
    assert job_state({"status": status}).phase == phase


# --------------------------------------------------------------------------- against the API server stand-in


RUNNING = {"jobDeploymentStatus": "Running", "jobStatus": "RUNNING"}
SUCCEEDED = {"jobDeploymentStatus": "Complete", "jobStatus": "SUCCEEDED"}
FAILED = {"jobDeploymentStatus": "Failed", "jobStatus": "FAILED", "reason": "AppFailed"}


@pytest.fixture
def rayjob_cluster(kmock, tmp_path, monkeypatch):
    kmock.resources["ray.io/v1/rayjobs"].kind = "RayJob"
    kmock.resources["ray.io/v1/rayjobs"].namespaced = True
    return Cluster(kmock, kubeconfig_of(kmock, tmp_path, monkeypatch), RAYJOB)


@pytest.fixture
def rayjob_config(tmp_path):
    return load_config(None, [
        "launch.backend=rayjob", f"launch.kubernetes.namespace={NAMESPACE}",
        "launch.kubernetes.wait_timeout_seconds=60", f"store.uri={tmp_path / 'store'}",
        "tracking.uri=http://mlflow.relaunch.svc:5000"])


def _launch(config):
    from relaunch.components.launchers import rayjob

    return rayjob.launch(config, pipeline_run_id=RUN_ID, resume_from=None)


def _head_pod(name: str) -> dict[str, str]:
    return {"ray.io/originated-from-cr-name": name, "ray.io/node-type": "head"}


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_launch_creates_the_rayjob_watches_it_and_succeeds_calling_only_what_the_role_grants(
        rayjob_cluster, rayjob_config):
    cluster = rayjob_cluster
    task = asyncio.create_task(asyncio.to_thread(_launch, rayjob_config))
    await cluster.wait_for(lambda: cluster.jobs(), "the RayJob to be created")
    (job,) = cluster.jobs()
    name = job["metadata"]["name"]
    assert job["spec"] == build_rayjob(rayjob_config, pipeline_run_id=RUN_ID)["spec"]
    await cluster.add_pod(f"{name}-head-x7k2p", {"phase": "Running"}, labels=_head_pod(name))
    await cluster.settle(name, RUNNING, cluster.log_requested, "the log request")
    result = await cluster.finish(task, name, SUCCEEDED)
    assert (result.exit_code, result.job_name) == (0, name)
    assert cluster.watching() >= 1 and len(cluster.requests("POST")) == 1
    # the exit handler's delete completes the Role's verbs
    from relaunch.components.launchers.cluster import delete_job

    assert (await asyncio.to_thread(delete_job, rayjob_config, RUN_ID)).deleted
    used = {api_call(r) for r in cluster.requests(None, "/")}
    role = next(d for d in yaml.safe_load_all((ROOT / "manifests" / "launch" / "rayjob" / "rbac.yaml").read_text())
                if d["kind"] == "Role")
    granted = {(g, res, verb) for rule in role["rules"] for g in rule["apiGroups"] for res in rule["resources"]
               for verb in rule["verbs"]}
    assert used == granted


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_running_rayjob_of_an_earlier_attempt_is_adopted_not_created_again(rayjob_cluster, rayjob_config):
    cluster = rayjob_cluster
    manifest = build_rayjob(rayjob_config, pipeline_run_id=RUN_ID)
    await cluster.put_job(manifest, RUNNING)
    task = asyncio.create_task(asyncio.to_thread(_launch, rayjob_config))
    await cluster.wait_for(lambda: cluster.watching(), "the launcher's watch")
    assert (await cluster.finish(task, manifest["metadata"]["name"], SUCCEEDED)).exit_code == 0
    assert not cluster.requests("POST") and len(cluster.jobs()) == 1


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_failed_rayjob_ends_with_the_code_the_training_recorded(rayjob_cluster, rayjob_config):
    """A user error (2) recorded by the trainer is permanent: kept, the RayJob neither deleted nor recreated."""
    cluster = rayjob_cluster
    manifest = build_rayjob(rayjob_config, pipeline_run_id=RUN_ID)
    await cluster.put_job(manifest, FAILED)
    write_exit_record(open_store(rayjob_config.store.uri), 1, ExitCode.BAD_INPUT, "bad input")
    result = await asyncio.to_thread(_launch, rayjob_config)
    assert result.exit_code == ExitCode.BAD_INPUT, result.message
    assert not cluster.requests("DELETE") and not cluster.requests("POST")


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_rayjob_failed_with_a_retryable_record_is_deleted_and_created_again(rayjob_cluster, rayjob_config):
    cluster = rayjob_cluster
    manifest = build_rayjob(rayjob_config, pipeline_run_id=RUN_ID)
    name = manifest["metadata"]["name"]
    await cluster.put_job(manifest, FAILED)
    write_exit_record(open_store(rayjob_config.store.uri), 1, ExitCode.KILLED, "killed")
    task = asyncio.create_task(asyncio.to_thread(_launch, rayjob_config))
    await cluster.wait_for(lambda: cluster.requests("POST"), "the RayJob to be created again")
    assert len(cluster.requests("DELETE")) == 1
    result = await cluster.finish(task, name, SUCCEEDED)
    assert result.exit_code == 0 and "recreated" in result.message


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_rayjob_past_its_deadline_is_a_retryable_138(rayjob_cluster, rayjob_config):
    cluster = rayjob_cluster
    task = asyncio.create_task(asyncio.to_thread(_launch, rayjob_config))
    await cluster.wait_for(lambda: cluster.jobs(), "the RayJob to be created")
    name = cluster.jobs()[0]["metadata"]["name"]
    result = await cluster.finish(task, name, {"jobDeploymentStatus": "Failed", "reason": "DeadlineExceeded"})
    assert result.exit_code == ExitCode.RETRY_ME
