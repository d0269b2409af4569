"""A gs:// store's credentials reach every training pod as Google's client libraries read them: the
store Secret's ``key.json`` mounted read-only, its path in ``GOOGLE_APPLICATION_CREDENTIALS``, and no
AWS keys demanded; an empty ``store_secret`` renders nothing (workload identity)."""

from __future__ import annotations

import pytest

from relaunch.components.core.contract.config_loading import load_config
from relaunch.components.launchers.pytorchjob import build_pytorchjob
from relaunch.components.launchers.trainjob import build_runtime, build_trainjob

GS = ["store.uri=gs://relaunch-ckpt/exp"]


def _pods(overrides: list[str]) -> list[tuple[dict, dict]]:
    """(pod spec, training container) of the PyTorchJob's replicas and of the TrainJob runtime."""
    job = build_pytorchjob(load_config(None, overrides), pipeline_run_id="uid-1")
    pods = [r["template"]["spec"] for r in job["spec"]["pytorchReplicaSpecs"].values()]
    runtime = build_runtime(load_config(None, ["launch.backend=trainjob", *overrides]))
    for replicated in runtime["spec"]["template"]["spec"]["replicatedJobs"]:
        pods.append(replicated["template"]["spec"]["template"]["spec"])
    return [(pod, pod["containers"][0]) for pod in pods]


def test_every_training_pod_of_a_gs_store_mounts_the_key_file_and_names_it_in_the_environment():
    for pod, container in _pods(GS):
        env = {e["name"]: e for e in container["env"]}
        assert env["GOOGLE_APPLICATION_CREDENTIALS"]["value"] == "/var/run/secrets/relaunch/store/key.json"
        assert "AWS_ACCESS_KEY_ID" not in env and "AWS_SECRET_ACCESS_KEY" not in env
        (volume,) = [v for v in pod["volumes"] if "secret" in v]
        assert volume["secret"] == {"secretName": "relaunch-store", "defaultMode": 0o400,
                                    "items": [{"key": "key.json", "path": "key.json"}]}
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
        assert mount == {"name": volume["name"], "mountPath": "/var/run/secrets/relaunch/store", "readOnly": True}


@pytest.mark.parametrize("overrides", [[*GS, "launch.kubernetes.store_secret="], ["store.uri=s3://bucket/x"]],
                         ids=["gs with workload identity", "s3"])
def test_no_key_file_is_mounted_for_workload_identity_or_another_store(overrides):
    for pod, container in _pods(overrides):
        assert not [v for v in pod["volumes"] if "secret" in v]
        assert "GOOGLE_APPLICATION_CREDENTIALS" not in {e["name"] for e in container["env"]}


def test_the_trainjob_of_a_gs_store_names_the_key_file_its_runtime_mounts():
    job = build_trainjob(load_config(None, ["launch.backend=trainjob", *GS]), pipeline_run_id="uid-1")
    env = {e["name"]: e.get("value") for e in job["spec"]["trainer"]["env"]}
    assert env["GOOGLE_APPLICATION_CREDENTIALS"] == "/var/run/secrets/relaunch/store/key.json"


@pytest.mark.schemas
def test_every_argo_step_of_a_gs_store_mounts_the_key_file_and_the_workflow_validates(crd_schema):
    from jsonschema import Draft7Validator

    from relaunch.pipelines.argo import BUILDERS, to_dict

    config = load_config(None, ["launch.backend=pytorchjob", *GS, "tracking.uri=http://mlflow.relaunch.svc:5000"])
    workflow = to_dict(BUILDERS["argo"](config))
    errors = list(Draft7Validator(crd_schema("argo-workflows/argoproj.io_workflows.yaml")).iter_errors(workflow))
    assert not errors, "\n".join(f"{list(e.path)}: {e.message[:200]}" for e in errors[:5])
    steps = [t for t in workflow["spec"]["templates"] if "container" in t]
    assert steps
    for template in steps:
        env = {e["name"]: e for e in template["container"]["env"]}
        assert env["GOOGLE_APPLICATION_CREDENTIALS"]["value"] == "/var/run/secrets/relaunch/store/key.json"
        assert "AWS_ACCESS_KEY_ID" not in env
        (mount,) = [v for v in template["container"]["volumeMounts"] if v["mountPath"].endswith("/store")]
        assert mount["readOnly"] is True
        (volume,) = template["volumes"]
        assert volume["secret"]["secretName"] == "relaunch-store"


def test_every_kfp_task_of_a_gs_store_mounts_the_store_secret_and_names_the_key_file(tmp_path):
    import yaml

    from relaunch.pipelines.kfp_cluster import compile_for_cluster

    path = tmp_path / "pipeline.yaml"
    compile_for_cluster(path, load_config(None, ["launch.backend=pytorchjob", *GS]))
    pipeline, platform = list(yaml.safe_load_all(path.read_text()))
    executors = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    for name, executor in pipeline["deploymentSpec"]["executors"].items():
        env = {e["name"]: e["value"] for e in executor["container"]["env"]}
        assert env["GOOGLE_APPLICATION_CREDENTIALS"] == "/var/run/secrets/relaunch/store/key.json", name
        volumes = executors[name]["secretAsVolume"]
        assert [(v["secretName"], v["mountPath"]) for v in volumes] == [
            ("relaunch-store", "/var/run/secrets/relaunch/store")], name
        assert not [s for s in executors[name].get("secretAsEnv", []) if s["secretName"] == "relaunch-store"]
