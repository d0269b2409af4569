"""The kubernetes launch backend against an HTTP Kubernetes API (kmock's emulator) through the real
``kubernetes`` client and a kubeconfig. The test plays the Training Operator: it moves job status
along and creates the replica pods whose end the launcher maps to the exit-code contract."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import kmock
import pytest

from components.core.exitcodes import ExitCode
from components.launchers.kubernetes import build_pytorchjob, launch
from tests.k8s.conftest import condition, terminated

RUN_ID = "9f3c2a1e-0000-4000-8000-00000000abcd"
pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]


def start_launch(config, resume_from=None):
    return asyncio.create_task(asyncio.to_thread(launch, config, pipeline_run_id=RUN_ID, resume_from=resume_from))


async def test_launch_creates_the_job_and_succeeds_when_it_succeeds(cluster, k8s_config):
    task = start_launch(k8s_config, resume_from="s3://relaunch-test/store/checkpoints/step-000000000020")
    await cluster.wait_for(lambda: cluster.jobs(), "the PyTorchJob to be created")
    (job,) = cluster.jobs()
    expected = build_pytorchjob(k8s_config, pipeline_run_id=RUN_ID,
                                resume_from="s3://relaunch-test/store/checkpoints/step-000000000020")
    assert job["metadata"]["name"] == expected["metadata"]["name"]
    assert job["spec"] == expected["spec"]
    await cluster.set_status(job["metadata"]["name"], {"conditions": [condition("Created"), condition("Running")],
                                                       "replicaStatuses": {"Master": {"active": 1}}})
    await cluster.set_status(job["metadata"]["name"], {"conditions": [condition("Created"), condition("Succeeded")]})
    result = await task
    assert (result.exit_code, result.job_name) == (0, job["metadata"]["name"])
    assert len(cluster.requests("POST")) == 1


async def test_a_409_on_create_adopts_the_existing_job_instead_of_making_a_second(cluster, k8s_config):
    manifest = build_pytorchjob(k8s_config, pipeline_run_id=RUN_ID)
    name = manifest["metadata"]["name"]
    original = dict(manifest, metadata=dict(manifest["metadata"], labels={"made-by": "the-other-attempt"}))
    await cluster.put_job(original, {"conditions": [condition("Running")]})
    # The race: our GET happens before the other attempt's create lands, our create after it.
    cluster.kmock["get", f"/apis/kubeflow.org/v1/namespaces/relaunch-test/pytorchjobs/{name}"][:1] << (
        kmock.KubernetesObjectNotFoundError)
    task = start_launch(k8s_config)
    await cluster.wait_for(lambda: cluster.requests("POST"), "the launcher's create")
    await cluster.set_status(name, {"conditions": [condition("Running"), condition("Succeeded")]})
    result = await task
    assert result.exit_code == 0
    (job,) = cluster.jobs()
    assert job["metadata"]["labels"] == {"made-by": "the-other-attempt"}


async def test_a_launcher_killed_mid_wait_and_started_again_leaves_exactly_one_job(cluster, k8s_config):
    env = dict(os.environ, KUBECONFIG=str(cluster.kubeconfig))
    code = ("import sys; from components.core.config import RelaunchConfig; "
            "from components.launchers.kubernetes import launch; "
            f"launch(RelaunchConfig.from_json(sys.argv[1]), pipeline_run_id={RUN_ID!r}, resume_from=None)")
    first = subprocess.Popen([sys.executable, "-c", code, k8s_config.to_json()], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        await cluster.wait_for(lambda: cluster.requests("GET", "/apis/kubeflow.org/v1/namespaces/relaunch-test/pytorchjobs")
                               and any(r.params.get("watch") == "true" for r in cluster.requests("GET")),
                               "the first launcher to be watching")
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    name = cluster.jobs()[0]["metadata"]["name"]
    await cluster.set_status(name, {"conditions": [condition("Running")]})
    task = start_launch(k8s_config)
    await cluster.wait_for(lambda: sum(r.params.get("watch") == "true" for r in cluster.requests("GET")) >= 2,
                           "the second launcher to be watching")
    await cluster.set_status(name, {"conditions": [condition("Running"), condition("Succeeded")]})
    result = await task
    assert result.exit_code == 0
    assert len(cluster.jobs()) == 1
    assert len(cluster.requests("POST")) == 1, "the second launcher must adopt, not create"


async def test_a_job_failed_with_a_retryable_code_is_recreated_once(cluster, k8s_config):
    manifest = build_pytorchjob(k8s_config, pipeline_run_id=RUN_ID, resume_from="s3://relaunch-test/old")
    name = manifest["metadata"]["name"]
    await cluster.put_job(manifest, {"conditions": [condition("Running"), condition("Failed", "backoff limit")]})
    await cluster.add_pod(f"{name}-master-0", terminated(137, "OOMKilled"))
    task = start_launch(k8s_config, resume_from="s3://relaunch-test/old")
    await cluster.wait_for(lambda: cluster.requests("POST"), "the job to be created again")
    (job,) = cluster.jobs()
    assert "s3://relaunch-test/old" not in str(job["spec"]), "a recreated job resumes from the latest checkpoint"
    # The operator replaces the pods; the new master is evicted, so this attempt fails retryable too,
    # and the launcher leaves the next recreation to the next attempt.
    await cluster.delete_pod(f"{name}-master-0")
    await cluster.add_pod(f"{name}-master-0", {"phase": "Failed", "reason": "Evicted", "message": "node low on memory"})
    await cluster.set_status(name, {"conditions": [condition("Running"), condition("Failed", "pod evicted")]})
    result = await task
    assert result.exit_code == ExitCode.PREEMPTED
    assert len(cluster.requests("DELETE")) == 1
    assert len(cluster.requests("POST")) == 1
    assert "recreated" in result.message


async def test_a_job_failed_with_a_permanent_code_keeps_that_code_and_is_left_alone(cluster, k8s_config):
    manifest = build_pytorchjob(k8s_config, pipeline_run_id=RUN_ID)
    name = manifest["metadata"]["name"]
    await cluster.put_job(manifest, {"conditions": [condition("Failed", "worker exited 2")]})
    await cluster.add_pod(f"{name}-master-0", terminated(ExitCode.BAD_INPUT))
    await cluster.add_pod(f"{name}-worker-0", terminated(ExitCode.KILLED, "OOMKilled"))
    result = await asyncio.to_thread(launch, k8s_config, pipeline_run_id=RUN_ID, resume_from=None)
    assert result.exit_code == ExitCode.BAD_INPUT
    assert f"{name}-master-0" in result.message
    assert not cluster.requests("DELETE") and not cluster.requests("POST")
    assert len(cluster.jobs()) == 1


async def test_a_succeeded_job_from_an_earlier_attempt_means_success_without_creating(cluster, k8s_config):
    await cluster.put_job(build_pytorchjob(k8s_config, pipeline_run_id=RUN_ID), {"conditions": [condition("Succeeded")]})
    result = await asyncio.to_thread(launch, k8s_config, pipeline_run_id=RUN_ID, resume_from=None)
    assert result.exit_code == 0
    assert not cluster.requests("POST")


async def test_a_pod_that_can_never_start_fails_the_launch_as_bad_input(cluster, k8s_config):
    task = start_launch(k8s_config)
    await cluster.wait_for(lambda: cluster.jobs(), "the PyTorchJob to be created")
    name = cluster.jobs()[0]["metadata"]["name"]
    await cluster.add_pod(f"{name}-master-0", {"phase": "Pending", "containerStatuses": [{"name": "pytorch", "state": {
        "waiting": {"reason": "CreateContainerConfigError", "message": 'secret "relaunch-store" not found'}}}]})
    await cluster.set_status(name, {"conditions": [condition("Created")]})
    result = await task
    assert result.exit_code == ExitCode.BAD_INPUT
    assert "relaunch-store" in result.message


async def test_a_job_that_outlives_the_wait_timeout_is_left_running_for_the_next_attempt(cluster, k8s_config):
    k8s_config.launch.kubernetes.wait_timeout_seconds = 0.5
    result = await asyncio.to_thread(launch, k8s_config, pipeline_run_id=RUN_ID, resume_from=None)
    assert result.exit_code == ExitCode.RETRY_ME
    assert len(cluster.jobs()) == 1 and not cluster.requests("DELETE")


async def test_an_unreachable_api_server_is_a_retryable_failure(k8s_config, tmp_path, monkeypatch):
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\nclusters: [{name: c, cluster: {server: 'http://127.0.0.1:9'}}]\n"
        "users: [{name: u, user: {token: t}}]\ncontexts: [{name: c, context: {cluster: c, user: u}}]\n")
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    result = await asyncio.to_thread(launch, k8s_config, pipeline_run_id=RUN_ID, resume_from=None)
    assert result.exit_code == ExitCode.RETRY_ME
