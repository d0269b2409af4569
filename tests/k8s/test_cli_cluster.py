"""``relaunch compile``, ``submit`` and ``schedule`` end to end: the Argo objects land in an HTTP
Kubernetes API (kmock) through the kubeconfig, parameters are set by name, mistakes exit 2."""

from __future__ import annotations

import asyncio

import pytest
import yaml

from relaunch.pipelines.cli import main

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]


def argo_objects(cluster, plural: str) -> list[dict]:
    return [obj.raw for (res, _ns, _n), obj in cluster.kmock.objects.items() if res.plural == plural and not obj.deleted]


async def test_submit_argo_creates_one_workflow_with_the_parameters_given(cluster):
    cluster.kmock.resources["argoproj.io/v1alpha1/workflows"].namespaced = True
    code = await asyncio.to_thread(main, ["submit", "--target", "argo", "--param", "epochs=8",
                                          "--run-name", "relaunch-nightly-1", "--namespace", "relaunch-test"])
    assert code == 0
    (wf,) = argo_objects(cluster, "workflows")
    assert wf["metadata"]["name"] == "relaunch-nightly-1"
    params = {p["name"]: p["value"] for p in wf["spec"]["arguments"]["parameters"]}
    assert params["epochs"] == "8"


async def test_schedule_argo_creates_a_cron_workflow_that_forbids_overlap(cluster):
    cluster.kmock.resources["argoproj.io/v1alpha1/cronworkflows"].namespaced = True
    code = await asyncio.to_thread(main, ["schedule", "--target", "argo", "--cron", "15 2 * * 1",
                                          "--namespace", "relaunch-test"])
    assert code == 0
    (cron,) = argo_objects(cluster, "cronworkflows")
    assert cron["spec"]["schedules"] == ["15 2 * * 1"]
    assert cron["spec"]["concurrencyPolicy"] == "Forbid"


@pytest.mark.parametrize("argv", [
    ["submit", "--target", "argo", "--dry-run", "--param", "epoch=8"],          # no such parameter
    ["submit", "--target", "argo", "--dry-run", "--param", "epochs"],           # no value
    ["schedule", "--target", "argo", "--dry-run", "--cron", "every night"],
    ["compile", "--target", "argo", "--set", "launch.kubernetes.gpus_per_node=-1"],
])
async def test_cluster_commands_refuse_bad_input_with_exit_code_2(argv, capsys):
    assert main(argv) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


async def test_compile_writes_each_target_to_its_file(tmp_path):
    for target in ("kfp", "argo", "argo-template", "argo-cron"):
        out = tmp_path / f"{target}.yaml"
        assert main(["compile", "--target", target, "-o", str(out)]) == 0
        docs = list(yaml.safe_load_all(out.read_text()))
        assert docs[0]


async def test_render_pytorchjob_writes_the_manifest_the_launcher_would_create(tmp_path):
    out = tmp_path / "job.yaml"
    assert main(["render", "pytorchjob", "--run-id", "abc", "--set", "launch.nodes=3", "-o", str(out)]) == 0
    job = yaml.safe_load(out.read_text())
    assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 2


@pytest.mark.parametrize(("kind", "api_kind"), [("trainjob", "TrainJob"), ("trainingruntime", "ClusterTrainingRuntime")])
async def test_render_writes_the_trainer_v2_documents(kind, api_kind, tmp_path):
    out = tmp_path / f"{kind}.yaml"
    assert main(["render", kind, "--run-id", "abc", "--set", "launch.backend=trainjob", "--set", "launch.nodes=3",
                 "-o", str(out)]) == 0
    doc = yaml.safe_load(out.read_text())
    assert doc["kind"] == api_kind
    nodes = doc["spec"]["trainer"]["numNodes"] if kind == "trainjob" else doc["spec"]["mlPolicy"]["numNodes"]
    assert nodes == 3
