"""The TrainJob and the ClusterTrainingRuntime relaunch renders: valid against the Kubeflow Trainer v2.3.0
CRDs, the runtime grown from the stock ``torch-distributed`` one, and its failure rules derived from the
exit-code table: evaluated for every code, a permanent one never restarts the JobSet, a retryable one
always does."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import yaml
from jsonschema import Draft7Validator

from relaunch.components.core.contract.config_loading import load_config
from relaunch.components.core.contract.exitcodes import MEANING, PERMANENT, RETRYABLE, ExitCode
from relaunch.components.launchers.trainjob import build_runtime, build_trainjob, jobset_action
from relaunch.pipelines.cli import main

ROOT = Path(__file__).resolve().parents[2]
SHIPPED_RUNTIME = ROOT / "manifests" / "trainer" / "relaunch-torch.yaml"
# What manifests/trainer/relaunch-torch.yaml is rendered from (the services manifests/base runs).
SHIPPED_RUNTIME_CONFIG = ["launch.backend=trainjob", "store.uri=s3://relaunch/store",
                          "tracking.uri=http://mlflow.relaunch.svc:5000"]
OWNER = {"apiVersion": "argoproj.io/v1alpha1", "kind": "Workflow", "name": "relaunch-x7k2p", "uid": "5b0c-uid"}
VARIANTS = {
    "defaults": [],
    "gpus, elastic, tolerations, queue": [
        "launch.nodes=4", "launch.min_nodes=2", "launch.kubernetes.gpus_per_node=8",
        "launch.kubernetes.node_selector={pool: a100}", "launch.trainjob.queue_name=team-a",
        "launch.kubernetes.tolerations=[{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule}]",
        "launch.kubernetes.active_deadline_seconds=7200", "launch.trainjob.max_restarts=5"],
    "one node, no tracking secret": ["launch.nodes=1", "launch.kubernetes.tracking_secret=null"],
    "gs:// store, key file from the store Secret": ["store.uri=gs://relaunch-ckpt/exp"],
}
CODES = sorted({int(c) for c in MEANING if c != ExitCode.OK} | {4, 42, 125, 255})  # and codes outside the table


def config(overrides: list[str] = ()):
    return load_config(None, ["launch.backend=trainjob", *overrides])


def validate(crd_schema, doc: dict, crd: str) -> list[str]:
    schema = crd_schema(f"trainer-v2/trainer.kubeflow.org_{crd}.yaml")
    return [f"{list(e.path)}: {e.message[:200]}" for e in Draft7Validator(schema).iter_errors(doc)]


# --------------------------------------------------------------------------- schemas


@pytest.mark.schemas
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_rendered_trainjob_validates_against_the_trainer_v2_crd(variant, crd_schema):
    job = build_trainjob(config(VARIANTS[variant]), pipeline_run_id="uid-1", resume_from="s3://b/ck", owner=OWNER)
    assert (job["apiVersion"], job["kind"]) == ("trainer.kubeflow.org/v1alpha1", "TrainJob")
    assert not validate(crd_schema, job, "trainjobs")


@pytest.mark.schemas
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_rendered_cluster_training_runtime_validates_against_the_trainer_v2_crd(variant, crd_schema):
    runtime = build_runtime(config(VARIANTS[variant]))
    assert (runtime["apiVersion"], runtime["kind"]) == ("trainer.kubeflow.org/v1alpha1", "ClusterTrainingRuntime")
    assert not validate(crd_schema, runtime, "clustertrainingruntimes")
    # the same spec is valid as a namespaced TrainingRuntime, for teams without cluster rights
    assert not validate(crd_schema, dict(runtime, kind="TrainingRuntime"), "trainingruntimes")


@pytest.mark.schemas
def test_the_shipped_runtime_manifest_validates_and_the_crd_check_can_fail(crd_schema):
    shipped = yaml.safe_load(SHIPPED_RUNTIME.read_text())
    assert not validate(crd_schema, shipped, "clustertrainingruntimes")
    broken = copy.deepcopy(shipped)
    broken["spec"]["template"]["spec"]["failurePolicy"]["rules"][0]["action"] = "RestartEverything"
    assert validate(crd_schema, broken, "clustertrainingruntimes")


def test_the_shipped_runtime_manifest_is_what_relaunch_renders_golden():
    rendered = yaml.safe_dump(build_runtime(load_config(None, SHIPPED_RUNTIME_CONFIG)), sort_keys=False)
    if os.environ.get("RELAUNCH_UPDATE_GOLDEN"):
        SHIPPED_RUNTIME.write_text(rendered)
    assert SHIPPED_RUNTIME.read_text() == rendered, "regenerate with `make golden` and review the diff"


# --------------------------------------------------------------------------- failure rules from the table


@pytest.mark.parametrize("code", CODES)
def test_the_jobset_failure_rules_restart_exactly_the_retryable_codes(code):
    runtime = build_runtime(config())
    expected = "RestartJobSet" if code in RETRYABLE else "FailJobSet"
    assert jobset_action(runtime, code) == expected
    if code in PERMANENT:
        assert jobset_action(runtime, code) == "FailJobSet", "a permanent code must never be restarted"


def test_the_rule_evaluation_can_fail_when_the_rules_disagree_with_the_table():
    runtime = build_runtime(config())
    job_spec = runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]
    job_spec["podFailurePolicy"]["rules"][0]["onExitCodes"]["values"].append(int(ExitCode.BAD_INPUT))
    assert jobset_action(runtime, ExitCode.BAD_INPUT) == "RestartJobSet"


def test_the_runtime_restarts_the_whole_group_at_most_max_restarts_times_and_pods_never_in_place():
    runtime = build_runtime(config(["launch.trainjob.max_restarts=7"]))
    job_set = runtime["spec"]["template"]["spec"]
    assert job_set["failurePolicy"]["maxRestarts"] == 7
    job = job_set["replicatedJobs"][0]["template"]["spec"]
    assert job["backoffLimit"] == 0
    assert job["template"]["spec"]["restartPolicy"] == "Never"  # what podFailurePolicy requires


# --------------------------------------------------------------------------- grown from the stock runtime


def test_the_runtime_keeps_the_shape_of_the_stock_torch_distributed_runtime(schemas_dir):
    stock = yaml.safe_load((schemas_dir / "trainer-v2" / "runtime-torch_distributed.yaml").read_text())
    ours = build_runtime(config())
    assert ours["metadata"]["name"] == "relaunch-torch"
    assert ours["metadata"]["labels"]["trainer.kubeflow.org/framework"] == stock["metadata"]["labels"]["trainer.kubeflow.org/framework"]
    assert set(stock["spec"]["mlPolicy"]) <= set(ours["spec"]["mlPolicy"])
    (stock_job,) = stock["spec"]["template"]["spec"]["replicatedJobs"]
    (our_job,) = ours["spec"]["template"]["spec"]["replicatedJobs"]
    assert our_job["name"] == stock_job["name"]
    assert our_job["template"]["metadata"]["labels"] == stock_job["template"]["metadata"]["labels"]
    stock_container = stock_job["template"]["spec"]["template"]["spec"]["containers"][0]
    (container,) = our_job["template"]["spec"]["template"]["spec"]["containers"]
    assert container["name"] == stock_container["name"]


def test_the_runtime_runs_the_supervised_torchrun_with_shm_and_credentials_only_from_secrets():
    pod = build_runtime(config())["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"][:4] == ["python", "-m", "relaunch.components.launchers.supervise", "torchrun"]
    assert "--rdzv-endpoint=$(PET_MASTER_ADDR):$(PET_MASTER_PORT)" in container["command"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert pod["volumes"] == [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}}]
    assert pod["serviceAccountName"] == "relaunch-pipeline"
    env = {e["name"]: e for e in container["env"]}
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        assert set(env[key]) == {"name", "valueFrom"} and "secretKeyRef" in env[key]["valueFrom"], key


def test_the_trainjob_references_the_runtime_and_carries_the_queue_and_owner():
    job = build_trainjob(config(VARIANTS["gpus, elastic, tolerations, queue"]), pipeline_run_id="u", owner=OWNER)
    assert job["spec"]["runtimeRef"] == {"apiGroup": "trainer.kubeflow.org", "kind": "ClusterTrainingRuntime",
                                         "name": "relaunch-torch"}
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-a"
    assert job["metadata"]["ownerReferences"][0]["uid"] == OWNER["uid"]
    assert job["spec"]["trainer"]["numNodes"] == 4 and job["spec"]["trainer"]["numProcPerNode"] == 1
    assert job["spec"]["activeDeadlineSeconds"] == 7200


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(("overrides", "field"), [
    (["launch.backend=volcano"], "launch.backend"),
    (["launch.backend=trainjob", "launch.trainjob.runtime=Relaunch_Torch"], "launch.trainjob.runtime"),
    (["launch.backend=trainjob", f"launch.trainjob.runtime={'r' * 64}"], "launch.trainjob.runtime"),
    (["launch.backend=trainjob", "launch.nodes=0"], "launch.nodes"),
])
def test_bad_trainjob_settings_are_refused_in_one_line_with_exit_code_2(overrides, field, capsys):
    argv = ["render", "trainjob"] + [arg for o in overrides for arg in ("--set", o)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and field in err[0]


def test_the_retired_backend_name_kubernetes_is_refused_as_bad_input_naming_the_backends():
    from relaunch.components.core.contract.errors import BadInput

    with pytest.raises(BadInput, match="launch.backend") as refused:
        load_config(None, ["launch.backend=kubernetes"])
    assert "pytorchjob" in str(refused.value)
