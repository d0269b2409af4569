"""relaunch run hands kfp.local's task commands to the warm servers (pipelines/local/warm_steps.py) only when
they are kfp's own lightweight-component script, and sends each step to the server that loaded what
it uses. A kfp upgrade that changes the script must show up here, not as a silently cold run."""

from __future__ import annotations

from kfp import dsl

from components import STEP_TABLE
from pipelines.kfp_pipeline import COMPONENT_BODIES, build_components
from pipelines.local.warm_steps import SERVER_IMPORTS, executor_call, server_for


def _command(component) -> list[str]:
    container = component.component_spec.implementation.container
    return [*(container.command or []), *(container.args or [])]


def test_kfps_lightweight_component_command_is_recognised_with_its_source_and_arguments():
    for step, component in build_components("python:3.11").items():
        source, args = executor_call(_command(component))
        assert f"def {COMPONENT_BODIES[step].__name__}(" in source
        assert args[args.index("--function_to_execute") + 1] == COMPONENT_BODIES[step].__name__


def test_a_command_that_is_not_kfps_script_runs_cold():
    assert executor_call(["python3", "-m", "components.prepare", "--config-json", "{}"]) is None
    assert executor_call(["sh", "-ec", "pip install x && python3 -m kfp.dsl.executor_main \"$@\"", "src"]) is None

    @dsl.container_component
    def container():
        return dsl.ContainerSpec(image="busybox", command=["echo", "hi"])

    assert executor_call(_command(container)) is None


def test_steps_that_use_torch_go_to_the_server_that_imported_it():
    for step, body in COMPONENT_BODIES.items():
        expected = "full" if STEP_TABLE[step].uses_torch else "light"
        assert server_for(["--executor_input", "{}", "--function_to_execute", body.__name__]) == expected
    assert {s for s, step in STEP_TABLE.items() if step.uses_torch} == {"launch", "evaluate"}
    assert server_for(["--function_to_execute", "someone_elses_step"]) == "full"
    assert "torch" not in SERVER_IMPORTS["light"] and "torch" in SERVER_IMPORTS["full"]
