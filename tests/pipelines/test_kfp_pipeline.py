"""The compiled KFP v2 pipeline: a valid PipelineSpec, the five steps wired right, retries and caching
from the one table, no secret values, and a golden YAML a reviewer sees changes in."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
import yaml
from google.protobuf import json_format
from kfp.pipeline_spec import pipeline_spec_pb2

from components.core.config import RelaunchConfig
from components.core.exitcodes import RETRY_POLICIES, STEPS
from pipelines.kfp_pipeline import compile_pipeline

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "kfp-pipeline.yaml"


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict:
    path = tmp_path_factory.mktemp("kfp") / "pipeline.yaml"
    compile_pipeline(str(path))
    return yaml.safe_load(path.read_text())


def _dag(compiled: dict) -> dict:
    """Every task of the pipeline, nested DAGs flattened, by task name."""
    tasks = dict(compiled["root"]["dag"]["tasks"])
    for comp in compiled["components"].values():
        tasks.update(comp.get("dag", {}).get("tasks", {}))
    return tasks


def test_compiled_yaml_parses_as_a_pipeline_spec(compiled):
    spec = json_format.ParseDict(compiled, pipeline_spec_pb2.PipelineSpec())
    assert spec.pipeline_info.name == "relaunch"


def test_the_five_steps_and_the_exit_task_are_tasks(compiled):
    names = set(_dag(compiled))
    assert set(STEPS) <= names
    assert "finalize" in names


@pytest.mark.parametrize("task, upstream", [
    ("locate-latest-checkpoint", {"prepare"}),
    ("launch", {"prepare", "locate-latest-checkpoint"}),
    ("evaluate", {"prepare", "launch"}),
])
def test_each_step_depends_on_the_steps_before_it(compiled, task, upstream):
    assert set(_dag(compiled)[task].get("dependentTasks", [])) == upstream


def test_register_runs_only_when_the_evaluation_gate_passed(compiled):
    tasks = compiled["root"]["dag"]["tasks"]["exit-handler-1"]
    handler = compiled["components"][tasks["componentRef"]["name"]]["dag"]["tasks"]
    gate = next(t for t in handler.values() if "triggerPolicy" in t and "condition" in t["triggerPolicy"])
    assert "evaluate-passed" in gate["triggerPolicy"]["condition"]
    assert set(gate["dependentTasks"]) >= {"evaluate"}
    assert "register" in compiled["components"][gate["componentRef"]["name"]]["dag"]["tasks"]


def test_the_exit_task_runs_whatever_the_pipeline_did(compiled):
    finalize = compiled["root"]["dag"]["tasks"]["finalize"]
    assert finalize["triggerPolicy"]["strategy"] == "ALL_UPSTREAM_TASKS_COMPLETED"
    assert finalize["dependentTasks"] == ["exit-handler-1"]
    assert "taskFinalStatus" in finalize["inputs"]["parameters"]["status"]


@pytest.mark.parametrize("step", STEPS)
def test_retries_come_from_the_exit_code_table(compiled, step):
    policy, retry = RETRY_POLICIES[step], _dag(compiled)[step]["retryPolicy"]
    assert retry == {"maxRetryCount": policy.limit, "backoffDuration": f"{policy.backoff_seconds}s",
                     "backoffFactor": float(policy.factor), "backoffMaxDuration": f"{policy.max_backoff_seconds}s"}


@pytest.mark.parametrize("step", [*STEPS, "finalize"])
def test_caching_is_off_for_every_step(compiled, step):
    # prepare too: its outputs name this pipeline run's MLflow run; the dataset is reused by content address
    assert not _dag(compiled)[step].get("cachingOptions", {}).get("enableCache", False)


def test_pipeline_parameters_are_typed_with_defaults_and_descriptions(compiled):
    params = compiled["root"]["inputDefinitions"]["parameters"]
    assert {"config_json", "epochs", "nodes", "inject_failure"} <= set(params)
    for name, spec in params.items():
        assert spec["parameterType"] in ("STRING", "NUMBER_INTEGER", "NUMBER_DOUBLE"), name
        assert "defaultValue" in spec and spec.get("description"), name
    assert RelaunchConfig.from_json(params["config_json"]["defaultValue"]) == RelaunchConfig()


def test_every_step_runs_in_the_project_image_without_installing_kfp(compiled):
    for executor in compiled["deploymentSpec"]["executors"].values():
        container = executor["container"]
        assert container["image"] == RelaunchConfig().launch.kubernetes.image
        assert "pip install" not in " ".join(container["command"])


def test_a_configured_image_and_config_become_the_defaults(tmp_path):
    config = RelaunchConfig.model_validate({"launch": {"nodes": 4, "kubernetes": {"image": "registry.example/r:9"}}})
    compile_pipeline(str(tmp_path / "p.yaml"), config)
    compiled = yaml.safe_load((tmp_path / "p.yaml").read_text())
    assert {e["container"]["image"] for e in compiled["deploymentSpec"]["executors"].values()} == {"registry.example/r:9"}
    default = compiled["root"]["inputDefinitions"]["parameters"]["config_json"]["defaultValue"]
    assert RelaunchConfig.from_json(default).launch.nodes == 4


def test_the_compiled_yaml_holds_no_secret_values(compiled, monkeypatch):
    text = yaml.safe_dump(compiled)
    for needle in ("AWS_SECRET_ACCESS_KEY=", "aws_secret", "MLFLOW_TRACKING_PASSWORD=", "password", "secret_key"):
        assert needle.lower() not in text.lower()
    from tests.services import S3_SECRET_KEY

    assert S3_SECRET_KEY not in text


@pytest.mark.parametrize("component, outputs", [
    ("prepare", "components.prepare:PrepareOutputs"),
    ("locate-latest-checkpoint", "components.locate:LocateOutputs"),
    ("launch", "components.launch:LaunchOutputs"),
    ("evaluate", "components.evaluate:EvaluateOutputs"),
    ("register", "components.register:RegisterOutputs"),
    ("finalize", "components.finalize:FinalizeOutputs"),
])
def test_component_outputs_match_the_step_outputs_in_order(compiled, component, outputs):
    import importlib

    module, name = outputs.split(":")
    fields = [f.name for f in dataclasses.fields(getattr(importlib.import_module(module), name))]
    declared = compiled["components"][f"comp-{component}"]["outputDefinitions"]["parameters"]
    assert sorted(declared) == sorted(fields)
    # the body returns a tuple in the dataclass's order; KFP maps it by the NamedTuple's order
    from pipelines import kfp_pipeline

    fn = getattr(kfp_pipeline, component.replace("-", "_")).python_func
    assert list(fn.__annotations__["return"]._fields) == fields


class _GoldenDumper(yaml.SafeDumper):
    """Our own string style: importing hera swaps SafeDumper's global str representer, which would
    make the golden depend on which tests ran first."""


def _literal_when_multiline(dumper, data: str):
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style="|" if "\n" in data else None)


_GoldenDumper.add_representer(str, _literal_when_multiline)


def test_the_golden_yaml_matches_the_default_pipeline(compiled):
    text = yaml.dump(compiled, Dumper=_GoldenDumper, sort_keys=True, width=1000)
    if os.environ.get("RELAUNCH_UPDATE_GOLDEN"):
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(text)
    assert GOLDEN.exists(), "no golden file: run `make golden`"
    assert GOLDEN.read_text() == text, "the compiled pipeline changed: review, then `make golden`"
