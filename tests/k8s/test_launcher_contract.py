"""The launcher contract, for each cluster backend (PyTorchJob and TrainJob), against an HTTP Kubernetes
API (kmock's emulator) through the real ``kubernetes`` client and a kubeconfig. The test plays the
operator: it moves job status along and creates the pods whose end the launcher maps to the exit-code
contract."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import kmock
import pytest
import yaml

from relaunch.components.core.contract.exitcodes import ExitCode
from relaunch.components.launchers import backend_module
from tests.k8s.conftest import BACKENDS

ROOT = Path(__file__).resolve().parents[2]
RUN_ID = "9f3c2a1e-0000-4000-8000-00000000abcd"
RESUME = "s3://relaunch-test/store/checkpoints/step-000000000020"
pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60), pytest.mark.parametrize("backend", BACKENDS)]


def launch(config, resume_from=None):
    module = backend_module(config)
    return module.launch(config, pipeline_run_id=RUN_ID, resume_from=resume_from)


def start_launch(config, resume_from=None):
    return asyncio.create_task(asyncio.to_thread(launch, config, resume_from))


async def test_launch_creates_the_job_and_succeeds_when_it_succeeds(cluster, k8s_config):
    task = start_launch(k8s_config, resume_from=RESUME)
    await cluster.wait_for(lambda: cluster.jobs(), "the job to be created")
    (job,) = cluster.jobs()
    expected = cluster.op.build(k8s_config, pipeline_run_id=RUN_ID, resume_from=RESUME)
    assert job["metadata"]["name"] == expected["metadata"]["name"]
    assert job["spec"] == expected["spec"]
    await cluster.set_status(job["metadata"]["name"], cluster.op.running())
    result = await cluster.finish(task, job["metadata"]["name"], cluster.op.succeeded())
    assert (result.exit_code, result.job_name) == (0, job["metadata"]["name"])
    assert len(cluster.requests("POST")) == 1


async def test_a_409_on_create_adopts_the_existing_job_instead_of_making_a_second(cluster, k8s_config):
    manifest = cluster.op.build(k8s_config, pipeline_run_id=RUN_ID)
    name = manifest["metadata"]["name"]
    original = dict(manifest, metadata=dict(manifest["metadata"], labels={"made-by": "the-other-attempt"}))
    await cluster.put_job(original, cluster.op.running())
    # The race: our GET happens before the other attempt's create lands, our create after it.
    cluster.kmock["get", f"{cluster.op.jobs_path}/{name}"][:1] << kmock.KubernetesObjectNotFoundError
    task = start_launch(k8s_config)
    await cluster.wait_for(lambda: cluster.requests("POST"), "the launcher's create")
    result = await cluster.finish(task, name, cluster.op.succeeded())
    assert result.exit_code == 0
    (job,) = cluster.jobs()
    assert job["metadata"]["labels"] == {"made-by": "the-other-attempt"}


async def test_a_launcher_killed_mid_wait_and_started_again_leaves_exactly_one_job(cluster, k8s_config):
    env = dict(os.environ, KUBECONFIG=str(cluster.kubeconfig))
    code = ("import sys; from relaunch.components.core.runtime.wiring import wire; wire(); "
            "from relaunch.components.core.contract.config import RelaunchConfig; "
            "from relaunch.components.launchers import backend_module; c = RelaunchConfig.from_json(sys.argv[1]); "
            f"backend_module(c).launch(c, pipeline_run_id={RUN_ID!r}, resume_from=None)")
    first = subprocess.Popen([sys.executable, "-c", code, k8s_config.to_json()], env=env, cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        await cluster.wait_for(lambda: cluster.watching() >= 1, "the first launcher to be watching")
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    name = cluster.jobs()[0]["metadata"]["name"]
    await cluster.set_status(name, cluster.op.running())
    task = start_launch(k8s_config)
    await cluster.wait_for(lambda: cluster.watching() >= 2, "the second launcher to be watching")
    result = await cluster.finish(task, name, cluster.op.succeeded())
    assert result.exit_code == 0
    assert len(cluster.jobs()) == 1
    assert len(cluster.requests("POST")) == 1, "the second launcher must adopt, not create"


async def test_a_job_failed_with_a_retryable_code_is_recreated_once(cluster, k8s_config):
    manifest = cluster.op.build(k8s_config, pipeline_run_id=RUN_ID, resume_from="s3://relaunch-test/old")
    name = manifest["metadata"]["name"]
    await cluster.put_job(manifest, cluster.op.failed("backoff limit"))
    await cluster.add_pod(name, cluster.op.terminated(137, "OOMKilled"))
    task = start_launch(k8s_config, resume_from="s3://relaunch-test/old")
    await cluster.wait_for(lambda: cluster.requests("POST"), "the job to be created again")
    (job,) = cluster.jobs()
    assert "s3://relaunch-test/old" not in str(job["spec"]), "a recreated job resumes from the latest checkpoint"
    # The operator replaces the pods; the new node 0 is evicted, so this attempt fails retryable too,
    # and the launcher leaves the next recreation to the next attempt.
    await cluster.delete_node0_pod(name)
    await cluster.add_pod(name, {"phase": "Failed", "reason": "Evicted", "message": "node low on memory"})
    result = await cluster.finish(task, name, cluster.op.failed("pod evicted"))
    assert result.exit_code == ExitCode.PREEMPTED
    assert len(cluster.requests("DELETE")) == 1
    assert len(cluster.requests("POST")) == 1
    assert "recreated" in result.message


async def test_a_job_failed_with_a_permanent_code_keeps_that_code_and_is_left_alone(cluster, k8s_config):
    manifest = cluster.op.build(k8s_config, pipeline_run_id=RUN_ID)
    name = manifest["metadata"]["name"]
    await cluster.put_job(manifest, cluster.op.failed("worker exited 2"))
    await cluster.add_pod(name, cluster.op.terminated(ExitCode.BAD_INPUT))
    await cluster.add_pod(f"{name}-other", cluster.op.terminated(ExitCode.KILLED, "OOMKilled"),
                          labels=cluster.op.node0_pod(name)[1] | {"batch.kubernetes.io/job-completion-index": "1"})
    result = await asyncio.to_thread(launch, k8s_config)
    assert result.exit_code == ExitCode.BAD_INPUT
    assert cluster.op.node0_pod(name)[0] in result.message
    assert not cluster.requests("DELETE") and not cluster.requests("POST")
    assert len(cluster.jobs()) == 1


async def test_a_succeeded_job_from_an_earlier_attempt_means_success_without_creating(cluster, k8s_config):
    await cluster.put_job(cluster.op.build(k8s_config, pipeline_run_id=RUN_ID), cluster.op.succeeded())
    result = await asyncio.to_thread(launch, k8s_config)
    assert result.exit_code == 0
    assert not cluster.requests("POST")


async def test_a_suspended_job_is_waited_for_not_failed_until_it_is_admitted_and_ends(cluster, k8s_config):
    manifest = cluster.op.build(k8s_config, pipeline_run_id=RUN_ID)
    name = manifest["metadata"]["name"]
    await cluster.put_job(manifest, cluster.op.suspended())
    task = start_launch(k8s_config)
    await cluster.wait_for(lambda: cluster.watching() >= 1, "the launcher to be watching")
    await cluster.set_status(name, cluster.op.suspended())  # an event while still queued: keep waiting
    await cluster.wait_for(lambda: cluster.watching() >= 1, "the launcher to keep watching")
    assert not task.done(), "a Suspended job must not end the wait"
    await cluster.set_status(name, cluster.op.running())
    assert (await cluster.finish(task, name, cluster.op.succeeded())).exit_code == 0


async def test_a_job_still_suspended_at_the_timeout_is_a_retryable_138_and_is_left_queued(cluster, k8s_config):
    k8s_config.launch.kubernetes.wait_timeout_seconds = 1.0
    await cluster.put_job(cluster.op.build(k8s_config, pipeline_run_id=RUN_ID), cluster.op.suspended())
    result = await asyncio.to_thread(launch, k8s_config)
    assert result.exit_code == ExitCode.RETRY_ME
    assert "Suspended" in result.message
    assert len(cluster.jobs()) == 1 and not cluster.requests("DELETE")


async def test_pods_that_never_schedule_end_the_launch_with_138_after_the_timeout(cluster, k8s_config):
    k8s_config.launch.kubernetes.wait_timeout_seconds = 1.0
    name = cluster.op.build(k8s_config, pipeline_run_id=RUN_ID)["metadata"]["name"]
    # The pod is there before the launch starts, so what it finds at the timeout does not race it.
    await cluster.add_pod(name, {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
         "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."}]})
    result = await asyncio.to_thread(launch, k8s_config)
    assert result.exit_code == ExitCode.RETRY_ME
    assert "Unschedulable" in result.message and "Insufficient nvidia.com/gpu" in result.message
    assert len(cluster.jobs()) == 1 and not cluster.requests("DELETE"), "the next attempt adopts it"


async def test_a_pod_that_can_never_start_fails_the_launch_as_bad_input(cluster, k8s_config):
    task = start_launch(k8s_config)
    await cluster.wait_for(lambda: cluster.jobs(), "the job to be created")
    name = cluster.jobs()[0]["metadata"]["name"]
    await cluster.add_pod(name, {"phase": "Pending", "containerStatuses": [{"name": cluster.op.container, "state": {
        "waiting": {"reason": "CreateContainerConfigError", "message": 'secret "relaunch-store" not found'}}}]})
    result = await cluster.finish(task, name, {"conditions": [{"type": "Created", "status": "True", "reason": "Created",
                                                               "message": ""}]})
    assert result.exit_code == ExitCode.BAD_INPUT
    assert "relaunch-store" in result.message


async def test_trainer_status_progress_is_reported_while_the_job_runs(cluster, k8s_config, backend, capfd):
    if backend == "pytorchjob":
        pytest.skip("only a TrainJob carries trainerStatus")
    task = start_launch(k8s_config)
    await cluster.wait_for(lambda: cluster.jobs(), "the job to be created")
    name = cluster.jobs()[0]["metadata"]["name"]
    printed: list[str] = []

    def progress_printed() -> bool:
        printed.append(capfd.readouterr().err)
        return re.search(r"Running .*42% ~120 s left loss=0\.31", "".join(printed)) is not None

    await cluster.settle(name, {**cluster.op.running(), "trainerStatus": {
        "progressPercentage": 42, "estimatedRemainingSeconds": 120, "metrics": [{"name": "loss", "value": "0.31"}]}},
        progress_printed, "the launcher to print the trainer's progress")
    assert (await cluster.finish(task, name, cluster.op.succeeded())).exit_code == 0


async def test_the_launcher_calls_exactly_what_the_backends_role_grants(cluster, k8s_config, backend):
    """A whole life: an earlier retryable failure (get, pods, delete, get), create, watch, node-0 log,
    success, then the exit handler of a workflow stopped after it (the run's jobs listed by label, then
    deleted); every call maps to one (group, resource, verb) of the Role, and every grant is used."""
    from relaunch.components.launchers.cluster import delete_job

    manifest = cluster.op.build(k8s_config, pipeline_run_id=RUN_ID)
    name = manifest["metadata"]["name"]
    await cluster.put_job(manifest, cluster.op.failed())
    await cluster.add_pod(name, cluster.op.terminated(143))
    task = start_launch(k8s_config)
    await cluster.wait_for(lambda: cluster.requests("POST"), "the job to be created again")
    await cluster.delete_node0_pod(name)
    await cluster.add_pod(name, {"phase": "Running"})
    await cluster.settle(name, cluster.op.running(), cluster.log_requested, "the log request")
    # kmock's pods have no log endpoint: the launcher shrugs (the log is a courtesy) and keeps watching.
    assert (await cluster.finish(task, name, cluster.op.succeeded())).exit_code == 0
    assert (await asyncio.to_thread(delete_job, k8s_config, RUN_ID)).deleted

    used = {api_call(r) for r in cluster.requests(None, "/")}
    role = next(d for d in yaml.safe_load_all((ROOT / "manifests" / "launch" / backend / "rbac.yaml").read_text())
                if d["kind"] == "Role")
    granted = {(g, res, verb) for rule in role["rules"] for g in rule["apiGroups"] for res in rule["resources"]
               for verb in rule["verbs"]}
    assert used == granted


def api_call(request) -> tuple[str, str, str]:
    """``(api group, resource, RBAC verb)`` of one Kubernetes API request."""
    parts = str(request.url.path).strip("/").split("/")
    group = "" if parts[0] == "api" else parts[1]
    rest = parts[parts.index("namespaces") + 2:]
    resource = rest[0] + (f"/{rest[2]}" if len(rest) > 2 else "")
    method = request.method.name if hasattr(request.method, "name") else str(request.method)
    verb = {"POST": "create", "DELETE": "delete", "PATCH": "patch", "PUT": "update"}.get(method.upper())
    if verb is None:
        verb = "get" if len(rest) > 1 else ("watch" if request.params.get("watch") == "true" else "list")
    return group, resource, verb


async def test_an_unreachable_api_server_is_a_retryable_failure(k8s_config, tmp_path, monkeypatch):
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\nclusters: [{name: c, cluster: {server: 'http://127.0.0.1:9'}}]\n"
        "users: [{name: u, user: {token: t}}]\ncontexts: [{name: c, context: {cluster: c, user: u}}]\n")
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    result = await asyncio.to_thread(launch, k8s_config)
    assert result.exit_code == ExitCode.RETRY_ME


async def test_the_exit_handler_deletes_this_runs_job_and_succeeds_again_once_it_is_gone(cluster, k8s_config):
    from relaunch.components.launchers.cluster import delete_job

    await cluster.put_job(cluster.op.build(k8s_config, pipeline_run_id=RUN_ID), cluster.op.running())
    await cluster.put_job(cluster.op.build(k8s_config, pipeline_run_id="another-run"), cluster.op.running())
    first = await asyncio.to_thread(delete_job, k8s_config, RUN_ID)
    assert first.deleted
    assert [j["metadata"]["annotations"]["relaunch.dev/pipeline-run-id"] for j in cluster.jobs()] == ["another-run"]
    again = await asyncio.to_thread(delete_job, k8s_config, RUN_ID)  # a retried exit handler
    assert (again.deleted, again.job_name) == (False, first.job_name)


async def test_the_exit_handler_of_a_stopped_study_deletes_every_trial_job_of_its_run_and_no_other(cluster, k8s_config):
    from relaunch.components.launchers.cluster import delete_job

    trials = []
    for number in range(3):
        trial = k8s_config.model_copy(deep=True)
        trial.name = f"{k8s_config.name}-trial-{number}"
        trials.append(cluster.op.build(trial, pipeline_run_id=RUN_ID))
        await cluster.put_job(trials[-1], cluster.op.running())
    await cluster.put_job(cluster.op.build(k8s_config, pipeline_run_id="another-run"), cluster.op.running())
    done = await asyncio.to_thread(delete_job, k8s_config, RUN_ID)  # the study's configuration: no launch job
    assert done.deleted
    assert [j["metadata"]["annotations"]["relaunch.dev/pipeline-run-id"] for j in cluster.jobs()] == ["another-run"]
    assert not (await asyncio.to_thread(delete_job, k8s_config, RUN_ID)).deleted  # retried: nothing left


async def test_a_transient_api_error_in_the_exit_handler_is_retryable(cluster, k8s_config):
    from relaunch.components.core.contract.errors import TransientFailure
    from relaunch.components.launchers.cluster import delete_job

    name = cluster.op.build(k8s_config, pipeline_run_id=RUN_ID)["metadata"]["name"]
    cluster.kmock["get", f"{cluster.op.jobs_path}/{name}"] << 503
    with pytest.raises(TransientFailure):
        await asyncio.to_thread(delete_job, k8s_config, RUN_ID)
