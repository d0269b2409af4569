"""The Trainer OptimizationJob of a study (``relaunch render optimizationjob``, behind ``tune.cluster``):
validated against its CRD (the Trainer's main branch, ../shared/schemas/trainer-v2/) and the CRD's CEL rules,
the trial's TrainJob kept on the runtime's exit-code rules, and the controller's ``KUBEFLOW_TRAINER_OPT_<NAME>``
variables read back by the entrypoint: in-process for each parameter kind, and by a real training process
whose stored configuration and MLflow params show the suggested values."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import uuid

import pytest
import yaml
from jsonschema import Draft7Validator

from relaunch.components.core.contract import suggestions
from relaunch.components.core.contract.config import RelaunchConfig
from relaunch.components.core.contract.config_loading import load_config
from relaunch.components.core.contract.errors import BadInput
from relaunch.components.core.contract.exitcodes import RETRYABLE
from relaunch.components.launchers.optimizationjob import build_optimization_job
from relaunch.components.launchers.trainjob import build_runtime, jobset_action
from relaunch.pipelines.cli import main
from tests.k8s.cel_rules import cel_errors
from tests.train.conftest import ROOT

CRD = "trainer-v2/trainer.kubeflow.org_optimizationjobs.yaml"
STUDY = ["launch.backend=trainjob", "tune.cluster=optimizationjob", "store.uri=s3://relaunch/store",
         "tracking.uri=http://mlflow.relaunch.svc:5000", "tune.study=lr-width", "tune.trials=6", "tune.parallel=3",
         "tune.space={train.lr: {type: log_uniform, low: 0.001, high: 0.3}, "
         "train.hidden_size: {type: int, low: 16, high: 128, step: 16}, "
         "train.epochs: {type: int, low: 1, high: 50}, "
         "train.weight_decay: {type: uniform, low: 0.0, high: 0.1}, "
         "train.global_batch_size: {type: categorical, choices: [32, 64, 128]}}"]


def study(*more: str) -> RelaunchConfig:
    return load_config(None, [*STUDY, *more])


def controller_env(job: dict, values: dict[str, str], trial: str) -> dict[str, str]:
    """What the OptimizationJob controller gives a trial's container (kubeflow/trainer's optimization
    controller: ``EnvOptParamPrefix + strings.ToUpper(strings.ReplaceAll(param.Name, "-", "_"))``), and the
    downward API's value of ``RELAUNCH_TRIAL`` (the JobSet label that names the TrainJob)."""
    env = {e["name"]: e["value"] for e in job["spec"]["trainJobTemplate"]["spec"]["trainer"]["env"] if "value" in e}
    env.update({"KUBEFLOW_TRAINER_OPT_" + name.replace("-", "_").upper(): value for name, value in values.items()})
    env["RELAUNCH_TRIAL"] = trial
    return env


def carried_config(job: dict) -> RelaunchConfig:
    command = job["spec"]["trainJobTemplate"]["spec"]["trainer"]["command"]
    return RelaunchConfig.from_json(command[command.index("--config-json") + 1])


@pytest.mark.schemas
def test_the_optimization_job_validates_against_its_crd_and_cel_rules(crd_schema):
    job = build_optimization_job(study())
    assert (job["apiVersion"], job["kind"]) == ("trainer.kubeflow.org/v1alpha1", "OptimizationJob")
    schema = crd_schema(CRD)
    assert [f"{list(e.path)}: {e.message[:200]}" for e in Draft7Validator(schema).iter_errors(job)] == []
    assert cel_errors(schema, job) == []


def _space(spec: dict, name: str) -> dict:
    return next(p["searchSpace"] for p in spec["parameters"] if p["name"] == name)


@pytest.mark.schemas
@pytest.mark.parametrize("break_it, rule", [
    (lambda s: s.update(parallelTrials=7), "parallelTrials cannot exceed numTrials"),
    (lambda s: _space(s, "train__lr")["logUniform"].update(min="0"), "min must be strictly greater than 0"),
    (lambda s: _space(s, "train__lr").update(uniform={"min": "1", "max": "2"}), "exactly one of the fields"),
    (lambda s: s["trainJobTemplate"]["metadata"].update(name="x"), "name and namespace cannot be set"),
    (lambda s: s["trainJobTemplate"]["spec"]["trainer"].update(numProcPerNode=0), "numProcPerNode must be greater"),
])
def test_the_cel_check_can_fail(break_it, rule, crd_schema):
    job = build_optimization_job(study())
    broken = copy.deepcopy(job)
    break_it(broken["spec"])
    assert any(rule in e for e in cel_errors(crd_schema(CRD), broken))


def test_the_space_is_rendered_in_the_apis_terms():
    parameters = {p["name"]: p["searchSpace"] for p in build_optimization_job(study())["spec"]["parameters"]}
    assert parameters == {
        "train__lr": {"logUniform": {"min": "0.001", "max": "0.3", "type": "Float"}},
        "train__hidden_size": {"categorical": {"choices": ["16", "32", "48", "64", "80", "96", "112", "128"]}},
        "train__epochs": {"uniform": {"min": "1", "max": "50", "type": "Int"}},
        "train__weight_decay": {"uniform": {"min": "0", "max": "0.1", "type": "Float"}},
        "train__global_batch_size": {"categorical": {"choices": ["32", "64", "128"]}},
    }
    spec = build_optimization_job(study())["spec"]
    assert spec["searchAlgorithm"] == {"random": {"seed": 0}}
    assert (spec["numTrials"], spec["parallelTrials"], spec["objectives"]) == (6, 3, [{"metric": "val_loss",
                                                                                        "direction": "Minimize"}])


@pytest.mark.parametrize("code", [137, 143, 1, 2])
def test_the_trials_trainjob_keeps_the_runtimes_exit_code_failure_rules(code):
    config = study()
    template = build_optimization_job(config)["spec"]["trainJobTemplate"]["spec"]
    runtime = build_runtime(config)
    assert template["runtimeRef"]["name"] == runtime["metadata"]["name"]
    assert template["trainer"]["command"][:4] == ["python", "-m", "relaunch.components.launchers.supervise", "torchrun"]
    assert jobset_action(runtime, code) == ("RestartJobSet" if code in RETRYABLE else "FailJobSet")


def test_the_entrypoint_maps_the_controllers_variables_onto_the_configuration():
    job = build_optimization_job(study())
    values = {"train__lr": "0.0123", "train__hidden_size": "48", "train__epochs": "7", "train__weight_decay": "0.05",
              "train__global_batch_size": "128"}
    trial = suggestions.from_environment(carried_config(job), controller_env(job, values, "lr-width-trial-3"))
    assert (trial.train.lr, trial.train.hidden_size, trial.train.epochs, trial.train.weight_decay,
            trial.train.global_batch_size) == (0.0123, 48, 7, 0.05, 128)
    assert trial.store.uri == "s3://relaunch/store/studies/lr-width/trials/lr-width-trial-3"
    trial_name = next(e for e in job["spec"]["trainJobTemplate"]["spec"]["trainer"]["env"] if e["name"] == "RELAUNCH_TRIAL")
    assert trial_name["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.labels['jobset.sigs.k8s.io/jobset-name']"


@pytest.mark.parametrize("values, named", [
    ({"train__lr": "0.5"}, "outside tune.space.train.lr's bounds"),
    ({"train__lr": "fast"}, "is not a number"),
    ({"train__epochs": "2.5"}, "is not a whole number"),
    ({"train__global_batch_size": "96"}, "is not one of tune.space.train.global_batch_size's choices"),
    ({"train__momentum": "0.9"}, "names no tune.space key"),
])
def test_a_bad_suggestion_is_refused_naming_the_variable(values, named):
    job = build_optimization_job(study())
    with pytest.raises(BadInput, match=named):
        suggestions.from_environment(carried_config(job), controller_env(job, values, "lr-width-trial-1"))


def test_render_optimizationjob_says_in_one_line_how_to_switch_it_on(capsys):
    argv = ["render", "optimizationjob", "--set", "launch.backend=trainjob",
            "--set", "tune.space={train.lr: {type: uniform, low: 0.01, high: 0.1}}"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--set tune.cluster=optimizationjob" in err[0]
    assert main([*argv, "--set", "tune.cluster=optimizationjob"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["kind"] == "OptimizationJob"


# --------------------------------------------------------------------------- a real training process


def _train(config: RelaunchConfig, env: dict[str, str], cwd) -> subprocess.CompletedProcess:
    child = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "KUBEFLOW_TRAINER_OPT_", "RELAUNCH_"))}
    return subprocess.run([sys.executable, "-m", "relaunch.components.train", "--config-json", config.to_json()],
                          cwd=cwd, env={**child, **env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                          timeout=180)


def _trial_of(tmp_path) -> tuple[RelaunchConfig, dict]:
    config = load_config(None, [
        "launch.backend=trainjob", "tune.cluster=optimizationjob", f"store.uri={tmp_path / 'store'}",
        f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}", f"tracking.experiment=opt-{uuid.uuid4().hex[:8]}",
        "train.max_steps=6", "train.checkpoint_every_steps=3", "tune.study=opt-study",
        "tune.space={train.lr: {type: log_uniform, low: 0.001, high: 0.3}, train.hidden_size: {type: int, low: 16, high: 64, step: 16}}"])
    job = build_optimization_job(config)
    return carried_config(job), job


@pytest.mark.slow
def test_a_training_process_applies_the_suggestions_of_its_environment(tmp_path):
    carried, job = _trial_of(tmp_path)
    env = controller_env(job, {"train__lr": "0.0123", "train__hidden_size": "48"}, "opt-study-trial-1")
    env = {k: v for k, v in env.items() if k.startswith(("KUBEFLOW_TRAINER_OPT_", "RELAUNCH_TRIAL"))}
    done = _train(carried, env, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    trial_dir = tmp_path / "store" / "studies" / "opt-study" / "trials" / "opt-study-trial-1"
    assert json.loads((trial_dir / "checkpoints" / "latest.json").read_text())["step"] == 6
    run_id = json.loads((trial_dir / "runs" / "mlflow-run.json").read_text())["run_id"]
    import mlflow

    params = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}").get_run(run_id).data.params
    assert (float(params["train.lr"]), int(params["train.hidden_size"])) == (0.0123, 48)


@pytest.mark.slow
def test_a_training_process_refuses_a_bad_suggestion_in_one_line_and_writes_nothing(tmp_path):
    carried, job = _trial_of(tmp_path)
    env = {"KUBEFLOW_TRAINER_OPT_TRAIN__LR": "3.0", "RELAUNCH_TRIAL": "opt-study-trial-2"}
    done = _train(carried, env, tmp_path)
    assert done.returncode == 2
    lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "KUBEFLOW_TRAINER_OPT_TRAIN__LR" in lines[0]
    assert not (tmp_path / "store").exists()
