"""How a finished PyTorchJob or TrainJob maps to the exit-code contract: conditions, container exit codes and
pod reasons (the evidence the Training Operator and the kubelet leave behind)."""

from __future__ import annotations

import pytest

from relaunch.components.core.contract.exitcodes import PERMANENT, RETRYABLE, ExitCode
from relaunch.components.launchers.jobs import failure_exit_code as map_failure, unstartable_reason
from relaunch.components.launchers.pytorchjob import KIND, job_state
from relaunch.components.launchers.trainjob import KIND as TRAINJOB, job_state as trainjob_state
from tests.k8s.conftest import condition, terminated

FAILED = {"status": {"conditions": [condition("Running"), condition("Failed", "PyTorchJob failed")]}}


def failure_exit_code(job: dict, pods: list[dict]) -> tuple[int, str]:
    return map_failure(KIND, job, pods)


def pod(name: str, status: dict) -> dict:
    return {"metadata": {"name": name}, "status": status}


@pytest.mark.parametrize(("pods", "expected"), [
    ([pod("m", terminated(137, "OOMKilled"))], ExitCode.KILLED),
    ([pod("m", terminated(1, "OOMKilled"))], ExitCode.KILLED),  # OOMKilled wins over the runtime's code
    ([pod("m", {"phase": "Failed", "reason": "Evicted", "message": "low memory"})], ExitCode.PREEMPTED),
    ([pod("m", {"phase": "Failed", "reason": "NodeShutdown"})], ExitCode.PREEMPTED),
    ([pod("m", terminated(143))], ExitCode.PREEMPTED),
    ([pod("m", terminated(138))], ExitCode.RETRY_ME),
    ([pod("m", terminated(2))], ExitCode.BAD_INPUT),
    ([pod("m", terminated(3))], ExitCode.DIVERGED),
    ([pod("m", terminated(139))], ExitCode.SEGFAULT),
    ([pod("m", terminated(137, "OOMKilled")), pod("w", terminated(2))], ExitCode.BAD_INPUT),  # permanent wins
    ([pod("m", terminated(0, "Completed")), pod("w", terminated(143))], ExitCode.PREEMPTED),
    ([pod("m", terminated(42))], ExitCode.BUG),  # outside the contract: never retried
    ([], ExitCode.BUG),
])
def test_a_failed_job_maps_to_the_exit_code_its_pods_left(pods, expected):
    code, message = failure_exit_code(FAILED, pods)
    assert code == expected
    assert "conditions:" in message


def test_every_code_of_the_contract_survives_the_mapping_unchanged():
    for code in sorted(PERMANENT | RETRYABLE):
        assert failure_exit_code(FAILED, [pod("m", terminated(code))])[0] == code


def test_a_job_past_its_active_deadline_is_a_retryable_timeout():
    job = {"status": {"conditions": [condition("Failed", "PyTorchJob relaunch is active more than specified deadline",
                                               reason="DeadlineExceeded")]}}
    assert failure_exit_code(job, [])[0] == ExitCode.RETRY_ME


def test_a_container_restarted_in_place_reports_its_last_termination():
    status = {"phase": "Running", "containerStatuses": [{"name": "pytorch", "state": {"running": {}},
              "lastState": {"terminated": {"exitCode": 2, "reason": "Error"}}}]}
    assert failure_exit_code(FAILED, [pod("m", status)])[0] == ExitCode.BAD_INPUT


@pytest.mark.parametrize(("conditions", "phase"), [
    ([], "Pending"),
    ([condition("Created")], "Pending"),
    ([condition("Created"), condition("Running")], "Running"),
    ([condition("Running"), condition("Restarting"), condition("Running")], "Running"),
    ([condition("Running"), condition("Succeeded")], "Succeeded"),
    ([condition("Running"), condition("Failed")], "Failed"),
    ([condition("Running"), {"type": "Failed", "status": "False"}], "Running"),
    ([condition("Created"), condition("Suspended")], "Suspended"),
])
def test_the_job_phase_is_read_from_its_newest_true_condition(conditions, phase):
    assert job_state({"status": {"conditions": conditions}}).phase == phase


@pytest.mark.parametrize(("reason", "fatal"), [
    ("CreateContainerConfigError", True), ("InvalidImageName", True),
    ("ContainerCreating", False), ("ImagePullBackOff", False),  # a registry hiccup may pass
])
def test_only_containers_that_can_never_start_stop_the_wait(reason, fatal):
    pods = [pod("m", {"phase": "Pending", "containerStatuses": [{"name": "pytorch", "state": {"waiting": {"reason": reason}}}]})]
    assert (unstartable_reason(pods) is not None) == fatal


def true(kind: str) -> dict:
    return {"type": kind, "status": "True", "reason": kind, "message": ""}


@pytest.mark.parametrize(("job", "phase"), [
    ({"status": {}}, "Pending"),
    ({"spec": {"suspend": True}, "status": {}}, "Suspended"),
    ({"status": {"conditions": [true("Suspended")]}}, "Suspended"),
    ({"status": {"jobsStatus": [{"name": "node", "active": 0, "ready": 0}]}}, "Pending"),
    ({"status": {"jobsStatus": [{"name": "node", "active": 2, "ready": 2}]}}, "Running"),
    ({"status": {"conditions": [true("Complete")]}}, "Succeeded"),
    ({"status": {"conditions": [true("Failed")]}}, "Failed"),
    ({"status": {"conditions": [{**true("Suspended"), "status": "False"}, true("Complete")]}}, "Succeeded"),
])
def test_the_trainjob_phase_is_read_from_its_conditions_and_child_jobs(job, phase):
    assert trainjob_state(job).phase == phase


def test_trainjob_progress_is_read_from_trainer_status_when_reported():
    status = {"trainerStatus": {"progressPercentage": 40, "estimatedRemainingSeconds": 90,
                                "metrics": [{"name": "loss", "value": "0.2"}]}}
    assert trainjob_state({"status": status}).progress == "40% ~90 s left loss=0.2"
    assert trainjob_state({"status": {}}).progress == ""


def test_a_failed_trainjob_maps_its_node_containers_exit_codes():
    pods = [pod("n0", terminated(2, container="node")), pod("n1", terminated(137, "OOMKilled", container="node"))]
    job = {"status": {"conditions": [true("Failed")]}}
    assert map_failure(TRAINJOB, job, pods)[0] == ExitCode.BAD_INPUT
    assert map_failure(TRAINJOB, job, pods[1:])[0] == ExitCode.KILLED
