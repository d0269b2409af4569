"""relaunch installs under ``relaunch.*``: a team's repository with its own ``components`` and
``pipelines`` packages (the names Kubeflow projects use) installs relaunch, trains its own task with
``relaunch run``, compiles the pipeline, and loads the registered model, with nothing shadowed."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from mlflow.tracking import MlflowClient

from tests.cli import relaunch, relaunch_run

OWN_TASK = '''
"""The team's task: relaunch's digits under another name, built from the team's own helpers."""
from components.helpers import WIDTH
from relaunch.components.tasks.digits import make_task as digits


def make_task(config):
    assert config.train.hidden_size == WIDTH
    return digits(config)
'''


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A team's repository: ``components/`` with its task and helpers, ``pipelines/`` with its own code."""
    root = tmp_path_factory.mktemp("team")
    (root / "components").mkdir()
    (root / "components" / "__init__.py").write_text('"""The team\'s own components."""\nOWNER = "team"\n')
    (root / "components" / "helpers.py").write_text("WIDTH = 32\n")
    (root / "components" / "own_task.py").write_text(textwrap.dedent(OWN_TASK))
    (root / "pipelines").mkdir()
    (root / "pipelines" / "__init__.py").write_text('"""The team\'s own pipelines."""\nOWNER = "team"\n')
    (root / "tmp").mkdir()
    return root


def team_env(root) -> dict[str, str]:
    return {"PYTHONPATH": str(root), "TMPDIR": str(root / "tmp")}


def test_the_team_packages_and_relaunch_import_side_by_side(project):
    code = ("import components, pipelines, relaunch.components.prepare, relaunch.pipelines.cli; "
            "print(components.OWNER, pipelines.OWNER)")
    out = subprocess.run([sys.executable, "-c", code], cwd=project, capture_output=True, text=True,
                         env={**os.environ, **team_env(project)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["team", "team"]


@pytest.mark.slow
def test_a_project_with_its_own_components_and_pipelines_trains_its_task_and_registers_it(project):
    task = ("--set", "train.task=components.own_task:make_task", "--set", "train.max_steps=20",
            "--set", "evaluate.gate_min=0")
    out = relaunch_run(project, *task, env=team_env(project))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]

    client = MlflowClient(f"sqlite:///{project}/.relaunch/mlflow.db")
    [version] = client.search_model_versions("name = 'relaunch-digits'")
    # a fresh interpreter, outside the project: the model brings the team's code and relaunch's along
    load = ("import mlflow, numpy as np; m = mlflow.pyfunc.load_model('models:/relaunch-digits/%s'); "
            "print(m.predict(np.zeros((2, 64), dtype=np.float32)).shape[0])" % version.version)
    loaded = subprocess.run([sys.executable, "-c", load], cwd=project / "tmp", capture_output=True, text=True,
                            env={**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
                                 "MLFLOW_TRACKING_URI": f"sqlite:///{project}/.relaunch/mlflow.db"})
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    assert loaded.stdout.split()[-1] == "2"

    compiled = relaunch(project, "compile", "--target", "kfp", "-o", str(project / "pipeline.yaml"), *task[:2],
                        env=team_env(project))
    assert compiled.returncode == 0, compiled.stderr
    text = (project / "pipeline.yaml").read_text()
    assert "from relaunch.pipelines.kfp_entry import call" in text and "components.own_task:make_task" in text
