"""The task's model as relaunch packages it: built from the task, loaded from a checkpoint, saved as
an MLflow pyfunc model (safetensors weights, the configuration, the code), and fingerprinted.

Loading a saved model unpickles nothing and needs only mlflow and torch: weights in
``model.safetensors``, the configuration as JSON, and as pyfunc ``code_paths`` both ``components/``
and the task's own top-level module or package, with this module as the ``loader_module``
(``mlflow.pyfunc.load_model("models:/relaunch-digits@champion").predict(x)``).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

from ..checkpoint import CheckpointManager, parse_checkpoint_uri
from ..checkpoint.fingerprint import model_fingerprint
from ..checkpoint.verify import checked_step
from ..contract.config import RelaunchConfig
from ..contract.errors import BadInput
from ..store import open_store
from ..runtime.wiring import wire
from ...tasks.base import load_task


def prepare_requirement_checks() -> None:
    """Have MLflow map the installed packages once, in a warm server before it forks: each ``save_model``
    of a fork (evaluate's logged model, register's) then checks the model's requirements against that map
    instead of scanning every installed distribution again (~0.3 CPU s each). Without it, the same checks
    run; only slower."""
    from mlflow.utils.requirements_utils import warn_dependency_requirement_mismatches

    warn_dependency_requirement_mismatches(["mlflow"])


def load_model(task, mgr, step: int):
    """The task's model with the weights of committed checkpoint ``step`` (nothing unpickled)."""
    from ..trainer.state import TrainingState  # torch: not for the CLI, which imports this for the step's outputs

    model = task.build_model()
    mgr.load(TrainingState(model), step=step)
    return model.eval()


def verify_checkpoint_uri(uri: str, config: RelaunchConfig | None = None, task=None) -> int:
    """The step of the committed checkpoint at ``uri``; BadInput when it is not one of ours, or (with
    ``config``) when it holds another model than the task (``task``, else the configuration's)
    builds. O(1): manifest, files and sizes."""
    return checked_step(uri, (lambda: task_fingerprint(config, task)) if config is not None else None)


def task_fingerprint(config: RelaunchConfig, task=None) -> str:
    return model_fingerprint((task or load_task(config.train.task, config)).build_model())


def save_model(config: RelaunchConfig, checkpoint_uri: str, path: Path, task=None, model=None) -> None:
    """Write an MLflow pyfunc model directory for ``checkpoint_uri`` into ``path``: safetensors
    weights, the configuration as JSON, ``components/`` and the task's own code (``task`` and
    ``model``, when the caller has them loaded, save reading the checkpoint again)."""
    import tempfile

    import mlflow
    import numpy as np
    import torch
    from mlflow.models import infer_signature
    from safetensors.torch import save_model as save_weights

    task = task or load_task(config.train.task, config)
    if model is None:
        store_uri, step = parse_checkpoint_uri(checkpoint_uri)
        with CheckpointManager(open_store(store_uri), async_save=False) as mgr:
            model = load_model(task, mgr, step)
    x = example_input(task)
    # save_model copies both into ``path``
    with tempfile.TemporaryDirectory(prefix="relaunch-model-") as tmp, \
            tempfile.TemporaryDirectory(prefix="relaunch-code-") as code:
        data = Path(tmp)
        save_weights(model, str(data / "model.safetensors"))  # safetensors' save_model: tied weights stored once
        (data / "config.json").write_text(config.to_json())
        if callable(getattr(task, "package_meta", None)):  # what the task serves with besides weights (a tokenizer)
            (data / "task_meta.json").write_text(json.dumps(task.package_meta()))
        mlflow.pyfunc.save_model(
            str(path), loader_module=__name__, data_path=str(data),
            code_paths=code_paths(config.train.task, Path(code)),
            signature=infer_signature(x, serve(task, model, x)),
            pip_requirements=[f"torch=={torch.__version__.split('+')[0]}", "safetensors", "numpy", "pydantic>=2",
                              "pyyaml", "scikit-learn"])


def example_input(task):
    """What the registered model's signature is inferred from: the task's ``example_input()``, else two
    rows of a classifier's test split."""
    import numpy as np

    if callable(getattr(task, "example_input", None)):
        return task.example_input()
    if callable(getattr(task, "build_splits", None)):
        return np.asarray(task.build_splits()["test"]["x"][:2])
    raise BadInput(f"the task {type(task).__name__} has no example_input(): add one to register its model")


def serve(task, model, inputs):
    """The registered model's ``predict``: the task's ``serve``, else a classifier's ``predict`` of a
    float32 array."""
    import numpy as np

    if callable(getattr(task, "serve", None)):
        return task.serve(model, inputs)
    if callable(getattr(task, "predict", None)):
        return task.predict(model, np.asarray(inputs, dtype=np.float32))
    raise BadInput(f"the task {type(task).__name__} has neither serve() nor predict(): add one to register its model")


def code_paths(task_spec: str, staging: Path) -> list[str]:
    """What a loader needs besides mlflow and torch: relaunch's ``components/``, staged under
    ``staging`` as ``relaunch/components`` (the name it imports under), and the top-level module (a
    file) or package (a folder) of the task, unless the task is relaunch's own.

    Raises:
        BadInput: the task's module cannot be found.
    """
    ours = staging / "relaunch"
    shutil.copytree(Path(__file__).resolve().parents[2], ours / "components",
                    ignore=shutil.ignore_patterns("__pycache__"))
    paths = [str(ours)]
    top = task_spec.split(":")[0].split(".")[0]
    if top == "relaunch":
        return paths
    spec = importlib.util.find_spec(top)
    if spec is None:
        raise BadInput(f"train.task: cannot find module {top!r} to bundle with the model; check PYTHONPATH")
    if spec.submodule_search_locations:  # a package (regular or namespace): its folder
        return paths + [next(iter(spec.submodule_search_locations))]
    return paths + [spec.origin]


class _LoadedModel:
    """What ``mlflow.pyfunc.load_model`` returns through :func:`_load_pyfunc`."""
    def __init__(self, task, model):
        self.task, self.model = task, model

    def predict(self, model_input, params=None):
        return serve(self.task, self.model, model_input)


def _load_pyfunc(data_path: str) -> _LoadedModel:
    """MLflow's loader hook: rebuild the task's model and load the safetensors weights."""
    from safetensors.torch import load_model as load_weights

    root = Path(data_path)
    wire()  # a fresh interpreter (mlflow.pyfunc.load_model): this is its entry point
    config = RelaunchConfig.from_json((root / "config.json").read_text())
    task = load_task(config.train.task, config)
    if (root / "task_meta.json").exists():  # the model's own, not what the store holds now
        task.use_package_meta(json.loads((root / "task_meta.json").read_text()))
    model = task.build_model()
    load_weights(model, str(root / "model.safetensors"))  # tied weights: stored once, both names filled
    return _LoadedModel(task, model.eval())
