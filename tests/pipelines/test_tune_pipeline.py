"""The tuning pipeline (``relaunch compile --target kfp|argo`` of a configuration with a ``tune:`` space):
prepare once, plan-trials, run-trial fanned out (KFP ParallelFor, Argo withParam), select-best-trial,
evaluate, register, the exit handler. Its KFP package loads with kfp 2.17's loader and parses as a
PipelineSpec; its Argo Workflow validates against the Argo schemas; the retry of each trial is where it is
honoured (KFP drops set_retry inside a ParallelFor, kubeflow/pipelines#12389: the trial step relaunches its
training itself; Argo retries each withParam item's pod by the template's retryStrategy); and it runs under
kfp.local with 2 trials, each trial's training killed once, relaunched inside its step and resumed from its
own checkpoint, the best one evaluated and registered."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from google.protobuf import json_format
from jsonschema import Draft7Validator, Draft202012Validator
from kfp.pipeline_spec import pipeline_spec_pb2

from relaunch.components.core.contract.config import RelaunchConfig
from relaunch.components.core.contract.config_loading import load_config
from relaunch.components.core.contract.exitcodes import argo_retry_expression
from relaunch.pipelines import argo
from relaunch.pipelines.cli import main
from relaunch.pipelines.commands.compile import render
from relaunch.pipelines.spec import TRIAL_RETRY, TUNE_PIPELINE, pipeline_config
from tests.k8s.conftest import argo_definitions, crd_schema  # noqa: F401 - the shared schema fixtures

ROOT = Path(__file__).resolve().parents[2]
TUNE = ROOT / "configs" / "tune.yaml"
CLUSTER = ["launch.backend=trainjob", "store.uri=s3://relaunch/store", "tracking.uri=http://mlflow.relaunch.svc:5000",
           "tune.storage=postgresql://mlflow@postgres.relaunch.svc/optuna", "tune.parallel=3", "tune.trials=6",
           "tune.trial_retries=2"]


def cluster_study() -> RelaunchConfig:
    return load_config(TUNE, CLUSTER)


@pytest.fixture(scope="module")
def kfp_package(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("kfp") / "tune.kfp.yaml"
    path.write_text(render("kfp", cluster_study()))
    return path


@pytest.fixture(scope="module")
def kfp_spec(kfp_package) -> dict:
    return next(yaml.safe_load_all(kfp_package.read_text()))


@pytest.fixture(scope="module")
def workflow() -> dict:
    return argo.to_dict(argo.build_workflow(cluster_study()))


def _tasks(spec: dict) -> dict[str, dict]:
    tasks = dict(spec["root"]["dag"]["tasks"])
    for comp in spec["components"].values():
        tasks.update(comp.get("dag", {}).get("tasks", {}))
    return tasks


# --------------------------------------------------------------------------- KFP


def test_the_compiled_tuning_pipeline_loads_with_kfps_loader_and_parses_as_a_pipeline_spec(kfp_package, kfp_spec):
    from kfp import components

    loaded = components.load_component_from_file(str(kfp_package))
    assert loaded.name == TUNE_PIPELINE.name
    spec = json_format.ParseDict(kfp_spec, pipeline_spec_pb2.PipelineSpec())
    assert spec.pipeline_info.name == "relaunch-tune"
    assert {"prepare", "plan-trials", "run-trial", "select-best-trial", "evaluate", "register", "finalize"} <= set(_tasks(kfp_spec))


def test_kfp_fans_the_trials_out_tune_parallel_at_once_and_waits_for_all_of_them(kfp_spec):
    tasks = _tasks(kfp_spec)
    loop_name, loop = next((n, t) for n, t in tasks.items() if t.get("parameterIterator"))
    assert loop["iteratorPolicy"]["parallelismLimit"] == 3
    assert loop["parameterIterator"]["items"]["inputParameter"].startswith("pipelinechannel--plan-trials-Output")
    body = kfp_spec["components"][loop["componentRef"]["name"]]["dag"]["tasks"]
    assert list(body) == ["run-trial"]
    assert loop_name in tasks["select-best-trial"]["dependentTasks"]
    evaluate = tasks["evaluate"]["inputs"]["parameters"]["config_json"]["taskOutputParameter"]
    assert evaluate == {"producerTask": "select-best-trial", "outputParameterKey": "config_json"}
    gate = next(t for t in tasks.values() if "condition" in t.get("triggerPolicy", {}))
    assert "evaluate-passed" in gate["triggerPolicy"]["condition"]
    assert "register" in kfp_spec["components"][gate["componentRef"]["name"]]["dag"]["tasks"]


def test_the_trial_retry_kfp_honours_is_inside_the_trial_step(kfp_spec):
    """KFP's backend drops a task's retryPolicy inside a ParallelFor (kubeflow/pipelines#12389, #13897): it
    stays in the IR for a backend that honours it, and the retry that applies is the trial step's own
    relaunch loop, driven by tune.trial_retries in the configuration the step receives."""
    run_trial = _tasks(kfp_spec)["run-trial"]
    assert run_trial["retryPolicy"]["maxRetryCount"] == TRIAL_RETRY.limit
    executor = kfp_spec["deploymentSpec"]["executors"][kfp_spec["components"]["comp-run-trial"]["executorLabel"]]
    source = "\n".join(executor["container"]["command"])
    assert 'call("run-trial"' in source
    item = run_trial["inputs"]["parameters"]["config_json"]
    assert item["componentInputParameter"].endswith("-loop-item") and item["parameterExpressionSelector"]
    carried = RelaunchConfig.from_json(kfp_spec["root"]["inputDefinitions"]["parameters"]["config_json"]["defaultValue"])
    assert carried.tune.trial_retries == 2
    assert carried.store.uri == "s3://relaunch/store/studies/relaunch"


# --------------------------------------------------------------------------- Argo


@pytest.mark.schemas
def test_the_tuning_workflow_validates_against_the_argo_schema_and_crd(workflow, argo_definitions, crd_schema):
    definitions = dict(argo_definitions)
    definitions["io.k8s.apimachinery.pkg.util.intstr.IntOrString"] = {"type": ["integer", "string"]}
    validator = Draft202012Validator({"$ref": "#/definitions/io.argoproj.workflow.v1alpha1.Workflow",
                                      "definitions": definitions})
    assert [f"{list(e.path)}: {e.message}" for e in validator.iter_errors(workflow)] == []
    assert list(Draft7Validator(crd_schema("argo-workflows/argoproj.io_workflows.yaml")).iter_errors(workflow)) == []


def test_argo_fans_the_trials_out_with_withparam_and_retries_each_items_pod(workflow):
    spec = workflow["spec"]
    assert spec["entrypoint"] == "relaunch-tune" and spec["onExit"] == "exit-handler"
    templates = {t["name"]: t for t in spec["templates"]}
    dag = templates["relaunch-tune"]
    assert dag["parallelism"] == 3
    tasks = {t["name"]: t for t in dag["dag"]["tasks"]}
    trial = tasks["run-trial"]
    assert trial["withParam"] == "{{tasks.plan-trials.outputs.parameters.trials}}"
    args = {p["name"]: p["value"] for p in trial["arguments"]["parameters"]}
    assert args["config_json"] == "{{item.config_json}}" and args["trial"] == "{{item.trial}}"
    retry = templates["run-trial"]["retryStrategy"]
    assert (retry["limit"], retry["retryPolicy"], retry["expression"]) == (
        str(TRIAL_RETRY.limit) if isinstance(retry["limit"], str) else TRIAL_RETRY.limit, "Always", argo_retry_expression())
    assert "run-trial" in tasks["select-best-trial"]["depends"]
    exit_tasks = {t["name"]: t for t in templates["exit-handler"]["dag"]["tasks"]}
    assert list(exit_tasks) == ["finalize", "delete-training-job"]  # a stopped study's trial jobs go
    assert exit_tasks["delete-training-job"]["when"] == "{{workflow.status}} != Succeeded"
    owner = {e["name"] for e in templates["run-trial"]["container"]["env"]}
    assert "RELAUNCH_OWNER_UID" in owner  # the workflow owns each trial's job


def test_the_study_storage_password_reaches_every_step_from_its_secret_and_never_the_compiled_pipeline():
    config = load_config(TUNE, [*CLUSTER, "launch.kubernetes.study_secret=relaunch-optuna"])
    workflow = argo.to_dict(argo.build_workflow(config))
    templates = {t["name"]: t for t in workflow["spec"]["templates"]}
    for step in ("plan-trials", "run-trial", "select-best-trial"):
        env = {e["name"]: e for e in templates[step]["container"]["env"]}
        assert env["PGPASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "relaunch-optuna", "key": "PGPASSWORD"}
    executors = yaml.safe_load_all(render("kfp", config))
    platform = [d for d in executors if "platforms" in d][0]["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    trial = next(v for k, v in platform.items() if "run-trial" in k)
    assert any(s["secretName"] == "relaunch-optuna" and {"secretKey": "PGPASSWORD", "envVar": "PGPASSWORD"} in s["keyToEnv"]
               for s in trial["secretAsEnv"])


def test_the_configuration_without_a_space_compiles_the_training_pipeline_unchanged():
    config = load_config(None, [])
    assert pipeline_config(config) is config
    assert argo.to_dict(argo.build_workflow(config))["spec"]["entrypoint"] == "relaunch"


@pytest.mark.parametrize("overrides, named", [
    (["launch.backend=trainjob", "store.uri=s3://relaunch/store"], "tune.storage is unset"),
    (["launch.backend=trainjob", "store.uri=s3://relaunch/store", "tune.storage=postgresql://u:hunter2@db/optuna"],
     "tune.storage holds a password"),
])
def test_a_study_the_cluster_cannot_run_is_refused_in_one_line_before_anything_is_written(overrides, named, tmp_path,
                                                                                             capsys):
    out = tmp_path / "w.yaml"
    argv = ["compile", "--target", "argo", "--config", str(TUNE), *[a for o in overrides for a in ("--set", o)],
            "-o", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and named in err[0] and "hunter2" not in err[0]
    assert not out.exists()


# --------------------------------------------------------------------------- kfp.local, 2 trials


@pytest.fixture(scope="module")
def local_study(tmp_path_factory):
    """The tuning pipeline under kfp.local: 2 trials at once, each training killed once at step 12 (torchrun
    may not restart it: launch.max_restarts=0), so only the trial step's own relaunch can finish it."""
    from kfp import local

    from relaunch.pipelines.kfp_pipeline import build_pipeline
    from relaunch.pipelines.local.kfp_fixes import install_local_fixes

    tmp = tmp_path_factory.mktemp("tune-pipeline")
    config = load_config(TUNE, [
        f"store.uri={tmp / 'store'}", f"tracking.uri=sqlite:///{tmp / 'mlflow.db'}",
        f"tracking.artifact_location={tmp / 'artifacts'}", "tune.study=kfp-local", "tune.trials=2", "tune.parallel=2",
        "tune.pruner.name=none", "train.max_steps=20", "train.checkpoint_every_steps=5", "train.step_sleep_seconds=0.05",
        "launch.max_restarts=0", "launch.inject_failure=kill-worker@step=12", "evaluate.gate_min=0.0"])
    install_local_fixes()
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp / "kfp-local"), raise_on_error=True)
    build_pipeline(config)(config_json=pipeline_config(config).to_json())
    return tmp, tmp / "store" / "studies" / "kfp-local"


@pytest.mark.slow
def test_under_kfp_local_each_killed_trial_is_relaunched_by_its_step_and_resumes_from_its_checkpoint(local_study):
    _, study = local_study
    for n in (0, 1):
        record = json.loads((study / "trials" / str(n) / "trial.json").read_text())
        assert (record["state"], record["retries"]) == ("complete", 1)
        attempts = [json.loads(p.read_text()) for p in sorted((study / "trials" / str(n) / "runs" / "attempts").glob("attempt-*.json"))]
        assert [a["resumed_from_step"] >= 5 for a in attempts] == [False, True]  # fresh, then from its checkpoint


@pytest.mark.slow
def test_under_kfp_local_the_best_trial_is_selected_evaluated_and_registered_from_its_own_run(local_study):
    tmp, study = local_study
    records = [json.loads((study / "trials" / str(n) / "trial.json").read_text()) for n in (0, 1)]
    best = min(records, key=lambda r: (r["value"], r["number"]))
    record = json.loads((study / "study.json").read_text())
    assert (record["state"], record["best_trial"], record["best_value"]) == ("finished", best["number"], best["value"])
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{tmp / 'mlflow.db'}")
    versions = client.search_model_versions("name='relaunch-digits'")
    assert [v.run_id for v in versions] == [best["run_id"]]
    parent = client.get_run(best["run_id"]).data.tags["mlflow.parentRunId"]
    children = client.search_runs([client.get_run(parent).info.experiment_id],
                                   f"tags.mlflow.parentRunId = '{parent}'")
    assert sorted(r.info.run_id for r in children) == sorted(r["run_id"] for r in records)
    assert client.get_run(parent).info.status == "FINISHED"
