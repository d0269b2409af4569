"""The Argo DAG and the KFP DAG are the same pipeline (steps, edges, parameters, retry limits), the
cluster KFP package carries kfp-kubernetes secrets-as-env, and no credential appears in any compiled
or rendered document even when the test credentials are in the environment."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from relaunch.components.core.contract.config_loading import load_config
from relaunch.pipelines.spec import RETRY_POLICIES, STEPS
from relaunch.components.launchers.pytorchjob import build_pytorchjob
from relaunch.components.launchers.trainjob import build_runtime, build_trainjob
from relaunch.pipelines.commands.compile import render
from relaunch.components.launchers.jobs import STORE_SECRET_KEYS, TRACKING_SECRET_KEYS
from tests.services import S3_ACCESS_KEY, S3_SECRET_KEY

ROOT = Path(__file__).resolve().parents[2]
MLFLOW_PASSWORD = "relaunch-test-mlflow-password-42"
CLUSTER = ["launch.backend=pytorchjob", "store.uri=s3://relaunch/store", "tracking.uri=http://mlflow.relaunch.svc:5000"]


@pytest.fixture(scope="module")
def compiled() -> dict[str, list[dict]]:
    config = load_config(None, CLUSTER)
    return {t: [d for d in yaml.safe_load_all(render(t, config)) if d] for t in ("kfp", "argo", "argo-template", "argo-cron")}


def kfp_graph(spec: dict) -> tuple[dict[str, set[str]], dict[str, dict]]:
    """Executor tasks of a compiled KFP pipeline: name -> upstream task names (groups flattened)."""
    components = spec["components"]
    edges: dict[str, set[str]] = {}
    tasks: dict[str, dict] = {}

    def walk(dag: dict, inherited: set[str]) -> None:
        for key, task in dag["tasks"].items():
            deps = set(task.get("dependentTasks", [])) | inherited
            comp = components[task["componentRef"]["name"]]
            if "dag" in comp:  # an exit handler or a condition: its tasks inherit its dependencies
                walk(comp["dag"], deps)
            else:
                edges[task["taskInfo"]["name"]] = deps
                tasks[task["taskInfo"]["name"]] = task

    walk(spec["root"]["dag"], set())
    # Dependencies on a group mean "on every task inside it" for our purpose: resolve to step names.
    known = set(edges)
    return {k: {d for d in v if d in known} for k, v in edges.items()}, tasks


def closure(edges: dict[str, set[str]]) -> set[tuple[str, str]]:
    pairs = {(u, v) for v, us in edges.items() for u in us}
    while True:
        more = {(a, d) for a, b in pairs for c, d in pairs if b == c} - pairs
        if not more:
            return pairs
        pairs |= more


def test_argo_and_kfp_run_the_same_steps_in_the_same_order(compiled):
    kfp_edges, _ = kfp_graph(compiled["kfp"][0])
    argo = {t["name"]: t for t in compiled["argo"][0]["spec"]["templates"]}
    argo_edges = {t["name"]: {t["depends"]} if t.get("depends") else set() for t in argo["relaunch"]["dag"]["tasks"]}
    main_kfp = {k: v for k, v in kfp_edges.items() if k != "finalize"}
    assert set(main_kfp) == set(argo_edges) == set(STEPS)
    assert closure(main_kfp) == closure(argo_edges)
    exit_tasks = {t["name"] for t in argo[compiled["argo"][0]["spec"]["onExit"]]["dag"]["tasks"]}
    assert "finalize" in kfp_edges and "finalize" in exit_tasks


def test_argo_and_kfp_take_the_same_parameters_with_the_same_defaults(compiled):
    kfp_params = compiled["kfp"][0]["root"]["inputDefinitions"]["parameters"]
    for doc in compiled["argo"] + compiled["argo-template"]:
        argo_params = {p["name"]: p["value"] for p in doc["spec"]["arguments"]["parameters"]}
        assert set(argo_params) == set(kfp_params)
        for name, spec in kfp_params.items():
            assert yaml.safe_load(argo_params[name]) == yaml.safe_load(str(spec.get("defaultValue", ""))) or (
                name == "config_json" and argo_params[name] == spec["defaultValue"]), name


def test_argo_and_kfp_retry_each_step_the_same_number_of_times(compiled):
    _, kfp_tasks = kfp_graph(compiled["kfp"][0])
    argo = {t["name"]: t for t in compiled["argo"][0]["spec"]["templates"]}
    for step in STEPS:
        kfp_retry = kfp_tasks[step]["retryPolicy"]
        assert kfp_retry["maxRetryCount"] == argo[step]["retryStrategy"]["limit"] == RETRY_POLICIES[step].limit
        assert kfp_retry["backoffDuration"] == argo[step]["retryStrategy"]["backoff"]["duration"]
        assert float(kfp_retry["backoffFactor"]) == float(argo[step]["retryStrategy"]["backoff"]["factor"])


def test_the_cluster_kfp_package_maps_the_secrets_to_env_on_every_executor(compiled):
    from google.protobuf import json_format
    from kfp.kubernetes import kubernetes_executor_config_pb2 as pb
    from kfp.pipeline_spec import pipeline_spec_pb2

    spec, platform = compiled["kfp"]
    json_format.ParseDict(spec, pipeline_spec_pb2.PipelineSpec())
    json_format.ParseDict(platform, pipeline_spec_pb2.PlatformSpec())
    executors = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    assert set(executors) == set(spec["deploymentSpec"]["executors"])
    for name, config in executors.items():
        json_format.ParseDict(config, pb.KubernetesExecutorConfig())
        secrets = {s["secretName"]: {k["envVar"] for k in s["keyToEnv"]} for s in config["secretAsEnv"]}
        assert secrets == {"relaunch-store": {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"},
                           "relaunch-mlflow": {"MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"}}, name


def test_no_credential_appears_in_any_compiled_or_rendered_document(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", S3_ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", S3_SECRET_KEY)
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "relaunch-test-user")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", MLFLOW_PASSWORD)
    config = load_config(None, CLUSTER)
    texts = {t: render(t, config) for t in ("kfp", "argo", "argo-template", "argo-cron")}
    texts["pytorchjob"] = yaml.safe_dump(build_pytorchjob(config, pipeline_run_id="uid", resume_from="s3://relaunch/x"))
    texts["trainjob"] = yaml.safe_dump(build_trainjob(config, pipeline_run_id="uid", resume_from="s3://relaunch/x"))
    texts["trainingruntime"] = yaml.safe_dump(build_runtime(config))
    if shutil.which("kubectl"):
        for build in ("base", "overlays/kind", "overlays/basic-auth", "overlays/pytorchjob", "trainer"):
            texts[build] = subprocess.run(["kubectl", "kustomize", str(ROOT / "manifests" / build)],
                                          check=True, capture_output=True, text=True).stdout
    for name, text in texts.items():
        for secret in (S3_ACCESS_KEY, S3_SECRET_KEY, MLFLOW_PASSWORD):
            assert secret not in text, f"{secret!r} leaked into {name}"
        assert "AWS_SECRET_ACCESS_KEY" in text or name.startswith("overlays") or name == "base", name
        for doc in yaml.safe_load_all(text):
            for entry in env_entries(doc):
                if entry["name"] in SECRET_KEYS:
                    assert "value" not in entry and "secretKeyRef" in entry["valueFrom"], (name, entry["name"])


SECRET_KEYS = set(STORE_SECRET_KEYS + TRACKING_SECRET_KEYS)


def env_entries(node) -> list[dict]:
    """Every ``{"name": ..., "value"/"valueFrom": ...}`` env entry anywhere in a document."""
    found = []
    if isinstance(node, dict):
        if "name" in node and ("value" in node or "valueFrom" in node):
            found.append(node)
        for value in node.values():
            found += env_entries(value)
    elif isinstance(node, list):
        for value in node:
            found += env_entries(value)
    return found


def without_rendezvous(command: list[str]) -> list[str]:
    return [arg for arg in command if not arg.startswith(("--rdzv-endpoint=", "--rdzv-id="))]


@pytest.mark.parametrize("overrides", [[], ["launch.nodes=4", "launch.procs_per_node=8", "launch.min_nodes=2",
                                            "launch.kubernetes.gpus_per_node=8", "launch.kubernetes.tracking_secret=null"]])
def test_the_pytorchjob_and_the_trainjob_for_one_config_train_the_same_way(overrides):
    config = load_config(None, [*CLUSTER, *overrides])
    pytorchjob = build_pytorchjob(config, pipeline_run_id="uid", resume_from="s3://relaunch/x")
    trainjob = build_trainjob(config, pipeline_run_id="uid", resume_from="s3://relaunch/x")
    trainer = trainjob["spec"]["trainer"]
    replicas = pytorchjob["spec"]["pytorchReplicaSpecs"]
    containers = [spec["template"]["spec"]["containers"][0] for spec in replicas.values()]
    for container in containers:
        assert container["image"] == trainer["image"]
        assert without_rendezvous(container["command"]) == without_rendezvous(trainer["command"])
        assert container["env"] == trainer["env"]
        assert container["resources"] == trainer["resourcesPerNode"]
    assert sum(spec["replicas"] for spec in replicas.values()) == trainer["numNodes"] == config.launch.nodes
    assert pytorchjob["spec"]["elasticPolicy"]["nProcPerNode"] == trainer["numProcPerNode"] == config.launch.procs_per_node
    assert pytorchjob["metadata"]["name"] == trainjob["metadata"]["name"]
