"""The training runtime variant for recovery from memory (``train.memory_tier``): JobSet's in-place
restart (``restartStrategy: InPlaceRestart``, alpha, Kubernetes >= 1.35) and, for a one-node job, the
supervised in-place agent as the pod's command; validated against the Trainer v2 CRDs."""

from __future__ import annotations

import copy

import pytest

from relaunch.components.launchers.trainjob import build_runtime, build_trainjob
from tests.k8s.test_trainjob import OWNER, config, validate

IN_PLACE = ["train.memory_tier=true", "launch.nodes=1", "launch.trainjob.runtime=relaunch-torch-inplace"]


def failure_policy(runtime: dict) -> dict:
    return runtime["spec"]["template"]["spec"]["failurePolicy"]


@pytest.mark.schemas
def test_the_in_place_runtime_variant_validates_against_the_trainer_crd_and_an_unknown_strategy_does_not(crd_schema):
    runtime = build_runtime(config(IN_PLACE))
    assert failure_policy(runtime)["restartStrategy"] == "InPlaceRestart"
    assert runtime["metadata"]["name"] == "relaunch-torch-inplace"
    assert not validate(crd_schema, runtime, "clustertrainingruntimes")
    assert not validate(crd_schema, dict(runtime, kind="TrainingRuntime"), "trainingruntimes")
    broken = copy.deepcopy(runtime)
    failure_policy(broken)["restartStrategy"] = "RestartInPlace"
    assert validate(crd_schema, broken, "clustertrainingruntimes")


@pytest.mark.schemas
def test_a_one_node_trainjob_with_the_memory_tier_runs_the_supervised_in_place_agent(crd_schema):
    job = build_trainjob(config(IN_PLACE), pipeline_run_id="uid-1", owner=OWNER)
    command = job["spec"]["trainer"]["command"]
    assert command[:6] == ["python", "-m", "relaunch.components.launchers.supervise", "python", "-m",
                           "relaunch.components.launchers.inplace"]
    assert command[-4:-2] == ["-m", "relaunch.components.train"] and "torchrun" not in command
    assert job["spec"]["runtimeRef"]["name"] == "relaunch-torch-inplace"
    assert not validate(crd_schema, job, "trainjobs")


def test_without_the_memory_tier_the_runtime_recreates_and_pods_run_torchrun():
    runtime = build_runtime(config([]))
    assert "restartStrategy" not in failure_policy(runtime)
    assert runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"][
        "containers"][0]["command"][3] == "torchrun"
