"""The launch backends' seam: a backend is one module and one ``register_launch_backend`` line, and
then the configuration accepts its name, ``relaunch.components.launch`` finds its module and ``relaunch
render`` offers its kinds (components/launchers/__init__.py)."""

from __future__ import annotations

import pytest

from relaunch.components.core.contract.config import RelaunchConfig
from relaunch.components.core.contract.config_loading import load_config
from relaunch.components.core.contract.errors import BadInput
from relaunch.components.launchers import LAUNCH_BACKENDS, LaunchResult, backend_module, register_launch_backend
from relaunch.pipelines.cli import main


# The toy backend: this test module is its module (launch and one render function).
def launch(config, *, pipeline_run_id: str, resume_from: str | None) -> LaunchResult:
    """Pretend every training succeeds at once."""
    return LaunchResult(exit_code=0, message=f"toy {pipeline_run_id}")


def render_toy(config, run_id: str) -> dict:
    """What the toy backend would submit."""
    return {"kind": "ToyJob", "name": f"toy-{run_id}", "nodes": config.launch.nodes}


@pytest.fixture
def toy_backend():
    register_launch_backend("toy", __name__, renders={"toyjob": "render_toy"})
    yield
    del LAUNCH_BACKENDS["toy"]


def test_an_unregistered_backend_is_refused_naming_the_registered_ones():
    with pytest.raises(BadInput, match=r"launch.backend.*'toy' is not a launch backend.*local, pytorchjob, trainjob"):
        load_config(None, ["launch.backend=toy"])


def test_a_registered_toy_backend_is_accepted_launched_and_rendered(toy_backend, tmp_path, capsys):
    config = load_config(None, ["launch.backend=toy", "launch.nodes=3"])
    assert config.launch.backend == "toy" and not config.launch.on_cluster
    assert backend_module(config).launch(config, pipeline_run_id="p1", resume_from=None).message == "toy p1"
    out = tmp_path / "toy.yaml"
    assert main(["render", "toyjob", "--run-id", "abc", "--set", "launch.nodes=3", "-o", str(out)]) == 0
    assert out.read_text() == "kind: ToyJob\nname: toy-abc\nnodes: 3\n"


def test_slurm_renders_but_is_not_a_launch_backend():
    assert "slurm" not in RelaunchConfig.model_fields and LAUNCH_BACKENDS["slurm"].renders == {"slurm": "render"}
    with pytest.raises(BadInput, match="'slurm' is not a launch backend"):
        load_config(None, ["launch.backend=slurm"])
