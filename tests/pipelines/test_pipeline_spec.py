"""The pipeline is written once (relaunch.pipelines.spec.PIPELINE) and both renderers draw that DAG: each step's
name, the source of each of its inputs, the steps it waits for, its condition and its retries are
read back from the compiled KFP package and the compiled Argo Workflow and compared with the spec."""

from __future__ import annotations

import re

import pytest
import yaml

from relaunch.pipelines.spec import CONFIG, FINAL_STATUS, PARAMETERS, PIPELINE, RUN_ID, Source, Step
from relaunch.components.core.contract.config import RelaunchConfig
from relaunch.components.core.contract.pipeline_parameters import PIPELINE_PARAMETERS
from relaunch.pipelines.argo import build_workflow, to_dict
from relaunch.pipelines.commands.compile import render

STEP_CHANNEL = re.compile(r"^\{\{tasks\.([a-z0-9-]+)\.outputs\.parameters\.(\w+)\}\}$")


@pytest.fixture(scope="module")
def kfp() -> dict[str, dict]:
    return read_kfp(next(yaml.safe_load_all(render("kfp", RelaunchConfig()))))


@pytest.fixture(scope="module")
def argo() -> dict[str, dict]:
    return read_argo(to_dict(build_workflow(RelaunchConfig())))


def spec_record(step: Step) -> dict:
    """What every renderer must draw of ``step``: inputs by name -> source, the steps it waits for,
    its condition, its retries, and whether it is in the exit handler."""
    inputs = {}
    for item in step.inputs:
        if item.source == PARAMETERS:
            inputs.update(dict.fromkeys(PIPELINE_PARAMETERS, PARAMETERS))
        else:
            inputs[item.name] = item.source
    when = step.when
    return {"inputs": inputs, "upstream": set(step.upstream()), "exit": step in PIPELINE.exit_handler,
            "condition": (when.source, when.op, when.value) if when else None,
            "retry": astuple(step.retry) if step.retry else None}


def astuple(policy) -> tuple:
    return (policy.limit, f"{policy.backoff_seconds}s", float(policy.factor), f"{policy.max_backoff_seconds}s")


# --------------------------------------------------------------------------- KFP, read back


def read_kfp(spec: dict) -> dict[str, dict]:
    """Executor tasks of a compiled KFP pipeline as spec records (groups flattened: a task inherits
    its groups' dependencies and condition; a group's inputs are traced to their producers)."""
    components, steps = spec["components"], {}

    def source(param: dict, channels: dict[str, Source], name: str) -> Source:
        if "taskOutputParameter" in param:
            out = param["taskOutputParameter"]
            return Source(out["producerTask"], out["outputParameterKey"])
        if "taskFinalStatus" in param:
            return FINAL_STATUS
        if param.get("runtimeValue", {}).get("constant") == "{{$.pipeline_job_uuid}}":
            return RUN_ID
        outer = param["componentInputParameter"]
        if outer in channels:
            return channels[outer]
        return CONFIG if outer == "config_json" else PARAMETERS

    def walk(dag: dict, inherited: set[str], channels: dict[str, Source], condition) -> None:
        for task in dag["tasks"].values():
            deps = set(task.get("dependentTasks", [])) | inherited
            params = task.get("inputs", {}).get("parameters", {})
            resolved = {n: source(p, channels, n) for n, p in params.items()}
            comp = components[task["componentRef"]["name"]]
            if "dag" in comp:  # an exit handler or a condition: its tasks inherit its dependencies
                test, inner = task.get("triggerPolicy", {}).get("condition"), condition
                if test:
                    channel, op, value = re.fullmatch(r"inputs\.parameter_values\['([^']+)'\] (==|!=) (.+)", test).groups()
                    inner = (resolved[channel], op, yaml.safe_load(value))
                walk(comp["dag"], deps, resolved, inner)
                continue
            exit_task = task.get("triggerPolicy", {}).get("strategy") == "ALL_UPSTREAM_TASKS_COMPLETED"
            retry = task.get("retryPolicy")
            steps[task["taskInfo"]["name"]] = {
                "inputs": resolved, "upstream": deps, "exit": exit_task, "condition": condition,
                "retry": (retry["maxRetryCount"], retry["backoffDuration"], float(retry["backoffFactor"]),
                          retry["backoffMaxDuration"]) if retry else None}

    walk(spec["root"]["dag"], set(), {}, None)
    for record in steps.values():  # dependencies on groups (the exit handler) are not steps
        record["upstream"] &= set(steps)
    return steps


# --------------------------------------------------------------------------- Argo, read back


def read_argo(workflow: dict) -> dict[str, dict]:
    """The DAG tasks of an Argo Workflow (main DAG and exit handler) as spec records."""
    templates = {t["name"]: t for t in workflow["spec"]["templates"]}
    steps = {}

    def source(value: str) -> Source:
        if match := STEP_CHANNEL.match(value):
            return Source(*match.groups())
        if value == "{{workflow.uid}}":
            return RUN_ID
        if value == "{{workflow.parameters.config_json}}":
            return CONFIG
        if value.startswith("{{workflow.parameters."):
            return PARAMETERS
        assert "workflow.status" in value or "workflow.name" in value, value
        return FINAL_STATUS

    def condition(when: str | None):
        if when is None:
            return None
        subject, op, value = when.split(" ")
        subject_source = FINAL_STATUS if subject == "{{workflow.status}}" else source(subject)
        return subject_source, op, yaml.safe_load(value)

    for dag_name, is_exit in ((workflow["spec"]["entrypoint"], False), (workflow["spec"]["onExit"], True)):
        for task in templates[dag_name]["dag"]["tasks"]:
            inputs = {}
            for p in task["arguments"]["parameters"]:
                value = source(p["value"])
                inputs["status" if value == FINAL_STATUS else p["name"]] = value  # state + error: one status
            retry = templates[task["template"]]["retryStrategy"]
            backoff = retry["backoff"]
            steps[task["name"]] = {
                "inputs": inputs, "depends": set(task["depends"].split(" && ")) if task.get("depends") else set(),
                "exit": is_exit, "condition": condition(task.get("when")),
                "retry": (int(retry["limit"]), backoff["duration"], float(backoff["factor"]), backoff["cap"])}
    return steps


def closure(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """Every step each step waits for, directly or not."""
    def above(name: str) -> set[str]:
        return set().union(*[{u} | above(u) for u in edges[name]])

    return {name: above(name) for name in edges}


# --------------------------------------------------------------------------- the comparison, step by step

ALL = PIPELINE.all_steps()


@pytest.mark.parametrize("step", ALL, ids=lambda s: s.name)
def test_every_input_a_step_reads_from_another_step_is_an_output_of_an_earlier_step(step):
    earlier = PIPELINE.steps[:PIPELINE.steps.index(step)] if step in PIPELINE.steps else ()
    for item in step.inputs:
        if item.source.step:
            producer = PIPELINE.step(item.source.step)
            assert producer in earlier, (step.name, item)
            assert item.source.output in dict(producer.output_fields()), (step.name, item)
    if step.when and step.when.source.step:
        assert step.when.source.output in dict(PIPELINE.step(step.when.source.step).output_fields())


def test_every_steps_outputs_and_module_exist_and_the_names_are_unique():
    assert len({s.name for s in ALL}) == len(ALL)
    for step in ALL:
        assert step.output_fields(), step.name
        assert callable(getattr(__import__(step.module, fromlist=["run"]), "run")), step.name


def test_both_renderers_draw_exactly_the_steps_of_the_spec(kfp, argo):
    assert list(argo) == [s.name for s in ALL]
    assert set(kfp) == {s.name for s in ALL if s.on_kfp}


@pytest.mark.parametrize("step", [s for s in ALL if s.on_kfp], ids=lambda s: s.name)
def test_kfp_draws_each_steps_inputs_dependencies_condition_and_retries_from_the_spec(kfp, step):
    expected = spec_record(step)
    if step in PIPELINE.exit_handler:
        expected["retry"] = None  # the one declared difference: KFP's exit task is not retried
    assert kfp[step.name] == expected


@pytest.mark.parametrize("step", ALL, ids=lambda s: s.name)
def test_argo_draws_each_steps_inputs_dependencies_condition_and_retries_from_the_spec(argo, step):
    expected = spec_record(step)
    drawn = dict(argo[step.name])
    assert drawn.pop("depends") == set(PIPELINE.dependencies(step))  # Argo's depends: no implied edge repeated
    del expected["upstream"]
    assert drawn == expected


def test_argo_and_kfp_order_the_steps_the_same_way(kfp, argo):
    kfp_edges = {name: record["upstream"] for name, record in kfp.items()}
    argo_edges = {name: record["depends"] for name, record in argo.items() if name in kfp}
    assert closure(kfp_edges) == closure(argo_edges)

