"""The PyTorchJob the launcher creates: valid against the Training Operator v1.9.4 CRD, named from the
pipeline run id, restarting only on the contract's retryable codes, credentials only by reference."""

from __future__ import annotations

import pytest
from jsonschema import Draft7Validator

from relaunch.components.core.contract.config_loading import load_config
from relaunch.components.launchers.k8s_naming import MAX_JOB_NAME, job_name
from relaunch.components.launchers.jobs import owner_from_env
from relaunch.components.launchers.pytorchjob import build_pytorchjob

OWNER = {"apiVersion": "argoproj.io/v1alpha1", "kind": "Workflow", "name": "relaunch-x7k2p", "uid": "5b0c-uid"}
VARIANTS = {
    "defaults": [],
    "gpus, elastic, tolerations": ["launch.nodes=4", "launch.min_nodes=2", "launch.kubernetes.gpus_per_node=8",
                                   "launch.kubernetes.node_selector={pool: a100}",
                                   "launch.kubernetes.tolerations=[{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}]",
                                   "launch.kubernetes.active_deadline_seconds=7200"],
    "one node, no tracking secret": ["launch.nodes=1", "launch.kubernetes.tracking_secret=null"],
    "gs:// store, key file from the store Secret": ["store.uri=gs://relaunch-ckpt/exp"],
}


@pytest.mark.schemas
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_rendered_pytorchjob_validates_against_the_training_operator_crd(variant, crd_schema):
    job = build_pytorchjob(load_config(None, VARIANTS[variant]), pipeline_run_id="uid-1", resume_from="s3://b/ck", owner=OWNER)
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    errors = list(Draft7Validator(crd_schema("training-operator/kubeflow.org_pytorchjobs.yaml", "v1")).iter_errors(job))
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors[:5])


@pytest.mark.schemas
def test_the_crd_check_can_fail(crd_schema):
    job = build_pytorchjob(load_config(), pipeline_run_id="uid-1")
    job["spec"]["pytorchReplicaSpecs"]["Master"]["replicas"] = "one"
    assert list(Draft7Validator(crd_schema("training-operator/kubeflow.org_pytorchjobs.yaml", "v1")).iter_errors(job))


def test_the_job_has_a_master_and_nodes_minus_one_workers_with_exit_code_restarts():
    job = build_pytorchjob(load_config(None, ["launch.nodes=3", "launch.min_nodes=2", "launch.max_restarts=5"]),
                           pipeline_run_id="uid-1")
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert {role: spec["replicas"] for role, spec in replicas.items()} == {"Master": 1, "Worker": 2}
    assert {spec["restartPolicy"] for spec in replicas.values()} == {"ExitCode"}
    assert job["spec"]["elasticPolicy"] == {"rdzvBackend": "c10d", "minReplicas": 2, "maxReplicas": 3,
                                            "maxRestarts": 5, "nProcPerNode": 1}
    command = replicas["Worker"]["template"]["spec"]["containers"][0]["command"]
    assert command[:4] == ["python", "-m", "relaunch.components.launchers.supervise", "torchrun"]
    assert command[command.index("-m", 4) + 1] == "relaunch.components.train"
    assert "--nnodes=2:3" in command


def test_gpus_shm_selector_and_tolerations_reach_every_replica():
    config = load_config(None, VARIANTS["gpus, elastic, tolerations"])
    for spec in build_pytorchjob(config, pipeline_run_id="u")["spec"]["pytorchReplicaSpecs"].values():
        pod = spec["template"]["spec"]
        container = pod["containers"][0]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"
        assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
        assert pod["volumes"][0]["emptyDir"] == {"medium": "Memory", "sizeLimit": "1Gi"}
        assert pod["nodeSelector"] == {"pool": "a100"}
        assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"


def test_the_job_name_is_stable_per_run_and_distinct_across_runs():
    config = load_config()
    a1 = build_pytorchjob(config, pipeline_run_id="run-a")["metadata"]["name"]
    assert a1 == build_pytorchjob(config, pipeline_run_id="run-a", resume_from="s3://b/x")["metadata"]["name"]
    assert a1 != build_pytorchjob(config, pipeline_run_id="run-b")["metadata"]["name"]
    long = job_name("a" * 40, "r" * 500)
    assert len(long) <= MAX_JOB_NAME and long[0].isalpha()


def test_the_owner_reference_ties_the_job_to_its_workflow():
    job = build_pytorchjob(load_config(), pipeline_run_id="u", owner=OWNER)
    (ref,) = job["metadata"]["ownerReferences"]
    assert {k: ref[k] for k in OWNER} == OWNER
    env = {"RELAUNCH_OWNER_API_VERSION": "argoproj.io/v1alpha1", "RELAUNCH_OWNER_KIND": "Workflow",
           "RELAUNCH_OWNER_NAME": "relaunch-x7k2p", "RELAUNCH_OWNER_UID": "5b0c-uid"}
    assert owner_from_env(env) == OWNER
    assert owner_from_env({**env, "RELAUNCH_OWNER_UID": ""}) is None


def test_resume_from_travels_in_the_workers_configuration():
    job = build_pytorchjob(load_config(), pipeline_run_id="u", resume_from="s3://relaunch/store/checkpoints/step-000000000040")
    command = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["command"]
    assert '"resume_from":"s3://relaunch/store/checkpoints/step-000000000040"' in command[-1]
