"""The training runtime variant for recovery from memory (``train.memory_tier``): JobSet's in-place
restart (``restartStrategy: InPlaceRestart``, alpha, Kubernetes >= 1.35) and the supervised in-place agent
as the pod's command, on several nodes with node 0's store at the address Trainer (or the Training
Operator) gives and the pod's own address from the downward API; validated against the Trainer v2 CRDs
and the PyTorchJob CRD."""

from __future__ import annotations

import copy

from jsonschema import Draft7Validator

import pytest

from relaunch.components.launchers.pytorchjob import build_pytorchjob
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


IN_PLACE_TWO_NODES = ["train.memory_tier=true", "launch.nodes=2", "launch.procs_per_node=2",
                      "launch.trainjob.runtime=relaunch-torch-inplace"]
AGENT = ["python", "-m", "relaunch.components.launchers.supervise", "python", "-m", "relaunch.components.launchers.inplace"]


def pod_address(env: list[dict]) -> dict:
    return next(e for e in env if e["name"] == "RELAUNCH_POD_IP")


@pytest.mark.schemas
def test_a_two_node_trainjob_with_the_memory_tier_runs_an_agent_per_node_meeting_at_node_0s_store(crd_schema):
    job = build_trainjob(config(IN_PLACE_TWO_NODES), pipeline_run_id="uid-1", owner=OWNER)
    command = job["spec"]["trainer"]["command"]
    assert command[:6] == AGENT and "torchrun" not in command
    for flag in ("--nnodes=2", "--node-rank=$(PET_NODE_RANK)", "--master-addr=$(PET_MASTER_ADDR)",
                 "--master-port=$(PET_MASTER_PORT)", "--node-address=$(RELAUNCH_POD_IP)", "--nproc-per-node=2"):
        assert flag in command, (flag, command)
    assert pod_address(job["spec"]["trainer"]["env"])["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert not validate(crd_schema, job, "trainjobs")
    runtime = build_runtime(config(IN_PLACE_TWO_NODES))
    pod = runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert pod["containers"][0]["command"][:6] == AGENT and pod_address(pod["containers"][0]["env"])
    assert not validate(crd_schema, runtime, "clustertrainingruntimes")


@pytest.mark.schemas
def test_a_two_node_pytorchjob_with_the_memory_tier_runs_the_agent_with_the_masters_store(crd_schema):
    job = build_pytorchjob(config(["train.memory_tier=true", "launch.nodes=2", "launch.backend=pytorchjob"]),
                           pipeline_run_id="uid-1")
    name = job["metadata"]["name"]
    for role in ("Master", "Worker"):
        container = job["spec"]["pytorchReplicaSpecs"][role]["template"]["spec"]["containers"][0]
        assert container["command"][:6] == AGENT
        assert {f"--master-addr={name}-master-0", "--master-port=23456", "--node-rank=$(PET_NODE_RANK)",
                "--node-address=$(RELAUNCH_POD_IP)"} <= set(container["command"])
        assert pod_address(container["env"])["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert not list(Draft7Validator(crd_schema("training-operator/kubeflow.org_pytorchjobs.yaml", "v1")).iter_errors(job))


def test_an_elastic_node_count_with_the_memory_tier_is_refused_naming_both_settings():
    from relaunch.components.core.contract.errors import BadInput

    with pytest.raises(BadInput, match="launch.min_nodes.*train.memory_tier=false") as refused:
        config(["train.memory_tier=true", "launch.nodes=3", "launch.min_nodes=2"])
    assert "\n" not in str(refused.value)
    assert config(["train.memory_tier=true", "launch.nodes=3", "launch.min_nodes=3"]).train.memory_tier


def test_the_memory_tier_on_a_backend_that_restarts_its_own_group_is_refused_naming_those_that_run_the_agent():
    from relaunch.components.core.contract.errors import BadInput

    with pytest.raises(BadInput) as refused:
        config(["launch.backend=ray", "train.memory_tier=true"])
    line = str(refused.value)
    assert "\n" not in line and "launch.backend=ray" in line and "train.memory_tier=false" in line
    assert "local, pytorchjob, trainjob" in line
    # the advice works: each backend it names takes the tier
    for backend in ("local", "pytorchjob", "trainjob"):
        assert config([f"launch.backend={backend}", "train.memory_tier=true"]).train.memory_tier


def test_rendering_a_slurm_script_with_the_memory_tier_exits_2_in_one_line_and_writes_nothing(tmp_path):
    from tests.cli import relaunch

    out = tmp_path / "job.sbatch"
    done = relaunch(tmp_path, "render", "slurm", "-o", str(out), "--set", "train.memory_tier=true")
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "train.memory_tier=false" in done.stderr
    assert not out.exists()
    assert relaunch(tmp_path, "render", "slurm", "-o", str(out)).returncode == 0 and out.exists()
