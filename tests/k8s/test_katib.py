"""The Katib Experiment of a study (``relaunch render katib``): checked against Katib's own API definitions
(../shared/schemas/katib/swagger.json: the Katib CRDs are schema-less) and the rules of Katib's experiment
webhook, its trial's job against the TrainJob / PyTorchJob CRD once Katib substituted a trial's values, the
exit-code failure rules of the job it keeps, the metrics line its File collector parses, and the trial's
configuration as the entrypoint makes it from the substituted environment."""

from __future__ import annotations

import copy
import json
import re

import pytest
import yaml
from jsonschema import Draft7Validator

from relaunch.components.core.contract import suggestions
from relaunch.components.core.contract.config import RelaunchConfig
from relaunch.components.core.contract.config_loading import load_config
from relaunch.components.core.contract.exitcodes import PERMANENT, RETRYABLE
from relaunch.components.core.trainer.metrics_file import format_line
from relaunch.components.launchers.katib import METRICS_FILE, build_experiment
from relaunch.components.launchers.trainjob import build_runtime, jobset_action
from relaunch.pipelines.cli import main
from tests.k8s.cel_rules import cel_errors

STUDY = ["store.uri=s3://relaunch/store", "tracking.uri=http://mlflow.relaunch.svc:5000", "tune.study=lr-width",
         "tune.trials=6", "tune.parallel=3", "tune.sampler.seed=7",
         "tune.space={train.lr: {type: log_uniform, low: 0.001, high: 0.3}, "
         "train.hidden_size: {type: int, low: 16, high: 128, step: 16}, "
         "train.weight_decay: {type: uniform, low: 0.0, high: 0.1}, "
         "train.global_batch_size: {type: categorical, choices: [32, 64, 128]}}"]
BACKENDS = {"trainjob": ("trainjobs", "trainer-v2/trainer.kubeflow.org_trainjobs.yaml", "v1alpha1"),
            "pytorchjob": ("pytorchjobs", "training-operator/kubeflow.org_pytorchjobs.yaml", "v1")}
TRIAL = "lr-width-x7k2p9qz"
# What Katib's suggestion could hand one trial (Katib's text of each value), by parameter name.
ASSIGNMENT = {"train__lr": "0.0123", "train__hidden_size": "48", "train__weight_decay": "0.05",
              "train__global_batch_size": "64"}
# Katib's default metrics filter (katib pkg/metricscollector/v1beta1/common/const.go DefaultFilter).
KATIB_DEFAULT_FILTER = r"([\w|-]+)\s*=\s*([+-]?\d*(\.\d+)?([Ee][+-]?\d+)?)"


def study(backend: str = "trainjob", *more: str) -> RelaunchConfig:
    return load_config(None, [f"launch.backend={backend}", *STUDY, *more])


# --------------------------------------------------------------------------- Katib's API and its webhook


@pytest.fixture(scope="session")
def katib_schema(schemas_dir) -> dict:
    """``v1beta1.Experiment`` of Katib's swagger.json, its references to Kubernetes types (which it does
    not define) taken as any object."""
    swagger = json.loads((schemas_dir / "katib" / "swagger.json").read_text())
    definitions = dict(swagger["definitions"])
    for ref in set(re.findall(r'"#/definitions/([^"]+)"', json.dumps(swagger))) - set(definitions):
        definitions[ref] = {"type": "object"}
    return {"$ref": "#/definitions/v1beta1.Experiment", "definitions": definitions}


def webhook_errors(experiment: dict) -> list[str]:
    """What Katib's experiment webhook refuses (katib pkg/webhook/v1beta1/experiment/validator/validator.go,
    its rules on the fields relaunch sets): enums swagger.json does not carry, counts, parameters, the
    trial template's placeholders and job, the File collector."""
    spec, errors = experiment["spec"], []
    if spec["objective"]["type"] not in ("minimize", "maximize"):
        errors.append("objective.type")
    if spec["objective"]["objectiveMetricName"] in spec["objective"].get("additionalMetricNames", []):
        errors.append("additionalMetricNames holds the objective")
    if spec["algorithm"]["algorithmName"] not in ("tpe", "random"):  # the hyperopt suggestion's, in katib-config
        errors.append("algorithm")
    if not (0 < spec["parallelTrialCount"] <= spec["maxTrialCount"] and 0 <= spec["maxFailedTrialCount"] <= spec["maxTrialCount"]):
        errors.append("counts")
    if spec.get("resumePolicy") not in ("Never", "LongRunning", "FromVolume"):
        errors.append("resumePolicy")
    names = set()
    for p in spec["parameters"]:
        names.add(p["name"])
        space = p["feasibleSpace"]
        if p["parameterType"] not in ("double", "int", "categorical", "discrete"):
            errors.append(f"{p['name']}: parameterType")
        if space.get("distribution", "uniform") not in ("uniform", "logUniform", "normal", "logNormal"):
            errors.append(f"{p['name']}: distribution")
        if p["parameterType"] in ("double", "int") and (space.get("list") or not space.get("min") or not space.get("max")):
            errors.append(f"{p['name']}: min/max")
        if p["parameterType"] == "categorical" and (set(space) - {"list", "distribution"} or not space.get("list")):
            errors.append(f"{p['name']}: list")
    template = spec["trialTemplate"]
    if not template.get("primaryContainerName") or not template.get("successCondition") or not template.get("failureCondition"):
        errors.append("trialTemplate: primaryContainerName, successCondition and failureCondition")
    text = json.dumps(template["trialSpec"])
    for tp in template["trialParameters"]:
        if tp["reference"] not in names and not re.fullmatch(r"\$\{trialSpec\.(Name|Namespace|Kind|APIVersion)\}", tp["reference"]):
            errors.append(f"trialParameter {tp['name']}: reference {tp['reference']} is no parameter")
        placeholder = "${trialParameters.%s}" % tp["name"]
        if placeholder not in text:
            errors.append(f"trialParameter {tp['name']}: not in the trialSpec")
        text = text.replace(placeholder, "test-value")
    if re.findall(r"\$\{trialParameters\..+?\}", text):
        errors.append("trialSpec: a placeholder of no trialParameter")
    job = template["trialSpec"]
    if job["metadata"].get("name") or job["metadata"].get("namespace") or not job.get("apiVersion") or not job.get("kind"):
        errors.append("trialSpec: metadata.name / namespace set, or apiVersion / kind missing")
    source = spec["metricsCollectorSpec"]["source"]["fileSystemPath"]
    if spec["metricsCollectorSpec"]["collector"]["kind"] != "File" or source["kind"] != "File" \
            or not source["path"].startswith("/") or source["format"] not in ("TEXT", "JSON"):
        errors.append("metricsCollectorSpec")
    return errors


def validate(katib_schema: dict, experiment: dict) -> list[str]:
    found = [f"{list(e.path)}: {e.message[:200]}" for e in Draft7Validator(katib_schema).iter_errors(experiment)]
    return found + webhook_errors(experiment)


def substituted(experiment: dict, assignment: dict[str, str] = ASSIGNMENT, trial: str = TRIAL) -> dict:
    """The job Katib creates for one trial: the trialSpec with every ``${trialParameters.X}`` replaced."""
    values = {**assignment, "trialName": trial}
    text = json.dumps(experiment["spec"]["trialTemplate"]["trialSpec"])
    for tp in experiment["spec"]["trialTemplate"]["trialParameters"]:
        text = text.replace("${trialParameters.%s}" % tp["name"], values[tp["reference"] if tp["reference"] in values else tp["name"]])
    job = json.loads(text)
    job["metadata"].update(name=trial, namespace="relaunch")
    return job


def containers(job: dict) -> list[dict]:
    if job["kind"] == "TrainJob":
        return [job["spec"]["trainer"]]
    return [c for r in job["spec"]["pytorchReplicaSpecs"].values() for c in r["template"]["spec"]["containers"]]


@pytest.mark.schemas
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_the_katib_experiment_validates_against_katibs_api_and_its_webhook_rules(backend, katib_schema):
    experiment = build_experiment(study(backend))
    assert (experiment["apiVersion"], experiment["kind"]) == ("kubeflow.org/v1beta1", "Experiment")
    assert validate(katib_schema, experiment) == []


@pytest.mark.schemas
def test_the_katib_check_can_fail(katib_schema):
    good = build_experiment(study())
    wrong_type = copy.deepcopy(good)
    wrong_type["spec"]["maxTrialCount"] = "six"  # what swagger.json says
    assert list(Draft7Validator(katib_schema).iter_errors(wrong_type))
    lost = copy.deepcopy(good)
    lost["spec"]["trialTemplate"]["trialParameters"].pop()  # the trial's name: its placeholder stays unreplaced
    assert validate(katib_schema, lost)
    float_type = copy.deepcopy(good)
    float_type["spec"]["parameters"][0]["parameterType"] = "float"
    assert validate(katib_schema, float_type)


@pytest.mark.schemas
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_a_katib_trial_is_relaunchs_job_and_validates_against_its_crd_with_the_values_substituted(backend, crd_schema):
    plural, path, version = BACKENDS[backend]
    job = substituted(build_experiment(study(backend)))
    schema = crd_schema(path, version)
    assert [e.message for e in Draft7Validator(schema).iter_errors(job)] == []
    assert cel_errors(schema, job) == []
    assert job["kind"] == {"trainjob": "TrainJob", "pytorchjob": "PyTorchJob"}[backend]
    for container in containers(job):
        assert container["command"][:4] == ["python", "-m", "relaunch.components.launchers.supervise", "torchrun"]
        assert not any("${" in arg for arg in container["command"])
    if backend == "pytorchjob":  # the rendezvous on the master of the job Katib named after the trial
        assert f"--rdzv-endpoint={TRIAL}-master-0:23456" in containers(job)[0]["command"]


def test_the_space_is_rendered_as_katib_parameters_with_log_uniform_as_its_distribution():
    parameters = {p["name"]: p for p in build_experiment(study())["spec"]["parameters"]}
    assert parameters["train__lr"] == {"name": "train__lr", "parameterType": "double", "feasibleSpace": {
        "min": "0.001", "max": "0.3", "distribution": "logUniform"}}
    assert parameters["train__hidden_size"]["parameterType"] == "int"
    assert parameters["train__hidden_size"]["feasibleSpace"] == {"min": "16", "max": "128", "step": "16",
                                                               "distribution": "uniform"}
    assert parameters["train__global_batch_size"] == {"name": "train__global_batch_size", "parameterType": "categorical",
                                                      "feasibleSpace": {"list": ["32", "64", "128"]}}
    spec = build_experiment(study())["spec"]
    assert spec["algorithm"] == {"algorithmName": "tpe", "algorithmSettings": [{"name": "random_state", "value": "7"}]}
    assert (spec["parallelTrialCount"], spec["maxTrialCount"]) == (3, 6)
    assert spec["objective"]["metricStrategies"] == [{"name": "val_loss", "value": "latest"}]


@pytest.mark.parametrize("code", sorted(int(c) for c in RETRYABLE | PERMANENT))
def test_a_trainjob_trial_keeps_the_runtimes_exit_code_failure_rules(code):
    config = study()
    job = build_experiment(config)["spec"]["trialTemplate"]["trialSpec"]
    runtime = build_runtime(config)
    assert job["spec"]["runtimeRef"] == {"apiGroup": "trainer.kubeflow.org", "kind": "ClusterTrainingRuntime",
                                         "name": runtime["metadata"]["name"]}
    assert jobset_action(runtime, code) == ("RestartJobSet" if code in RETRYABLE else "FailJobSet")


def test_a_pytorchjob_trial_restarts_by_exit_code():
    job = build_experiment(study("pytorchjob"))["spec"]["trialTemplate"]["trialSpec"]
    assert {r["restartPolicy"] for r in job["spec"]["pytorchReplicaSpecs"].values()} == {"ExitCode"}


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_the_entrypoint_makes_a_katib_trials_configuration_from_the_substituted_environment(backend):
    job = substituted(build_experiment(study(backend)))
    container = containers(job)[0]
    environ = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    carried = RelaunchConfig.from_json(container["command"][container["command"].index("--config-json") + 1])
    trial = suggestions.from_environment(carried, environ)
    assert (trial.train.lr, trial.train.hidden_size, trial.train.weight_decay, trial.train.global_batch_size) == \
        (0.0123, 48, 0.05, 64)
    assert trial.store.uri == f"s3://relaunch/store/studies/lr-width/trials/{TRIAL}"
    assert environ["RELAUNCH_METRICS_FILE"] == METRICS_FILE


def test_katibs_default_filter_reads_the_objective_from_the_line_the_training_writes():
    line = format_line(40, {"val_loss": 0.3412, "val_accuracy": 0.9133, "val_tiny": 1e-05})
    found = {m[0]: float(m[1]) for m in re.findall(KATIB_DEFAULT_FILTER, line)}
    assert found == {"step": 40.0, "val_loss": 0.3412, "val_accuracy": 0.9133, "val_tiny": 1e-05}
    experiment = build_experiment(study())
    names = [experiment["spec"]["objective"]["objectiveMetricName"], *experiment["spec"]["objective"]["additionalMetricNames"]]
    assert set(names) <= set(found)


def test_render_katib_writes_the_experiment_and_refuses_an_empty_space_in_one_line(tmp_path, capsys):
    out = tmp_path / "experiment.yaml"
    assert main(["render", "katib", *[a for o in ["launch.backend=trainjob", *STUDY] for a in ("--set", o)],
                 "-o", str(out)]) == 0
    assert yaml.safe_load(out.read_text())["kind"] == "Experiment"
    capsys.readouterr()
    assert main(["render", "katib", "--set", "launch.backend=trainjob"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tune.space is empty" in err[0]
