"""Step 4, ``evaluate``: load the final (or best) committed checkpoint, compute the task's metrics on
the held-out split, and give the register gate its verdict (``evaluate.gate_metric >= evaluate.gate_min``).
In the MLflow run the checkpoint becomes a LoggedModel (at its step, linked to the run) and the
metrics are logged linked to it and to the dataset, beside a confusion-matrix image when the task is a
classifier (it has ``predict``).

    python -m relaunch.components.evaluate --config-json "$(cat resolved.json)"
"""

from __future__ import annotations

import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .core.checkpoint import CheckpointManager
from .core.contract.config import RelaunchConfig
from .core.contract.errors import BadInput
from .core.tracking.client import call
from .core.tracking.context import Context
from .core.tracking.lineage import log_model_metrics, logged_model


@dataclass
class EvaluateOutputs:
    metrics_json: str
    passed: bool
    checkpoint_uri: str
    step: int


def run(config: RelaunchConfig, training_completed: bool | str = True) -> EvaluateOutputs:
    """Evaluate the checkpoint ``evaluate.checkpoint`` names on ``evaluate.split``.

    Args:
        training_completed: launch's verdict (``"true"``/``"false"`` from a step CLI); a training that
            did not reach its end is not evaluated and its gate fails, so the registry never sees it.

    Raises:
        BadInput: there is no committed checkpoint, or the gate metric is not one the task computes.
    """
    from .core.packaging.model import load_model, save_model
    from .tasks.base import load_task

    if str(training_completed).lower() != "true":
        print("evaluate: the training did not reach its end; not evaluated, nothing will be registered", file=sys.stderr)
        return EvaluateOutputs(metrics_json="{}", passed=False, checkpoint_uri="", step=-1)
    task = load_task(config.train.task, config)
    context = Context(config)
    with CheckpointManager.from_config(config, async_save=False) as mgr:
        info = None
        if config.evaluate.checkpoint == "best":  # the newest when no checkpoint has the metric
            info = mgr.best(config.train.best_metric, config.train.best_mode)
        info = info or mgr.latest()
        if info is None:
            raise BadInput(f"evaluate: no committed checkpoint in {config.store.uri!r}; did launch run?")
        model = load_model(task, mgr, info.step)
    split = _split(context, task)
    metrics = {name: float(value) for name, value in task.evaluate(model, split).items()}
    gate = config.evaluate.gate_metric
    if gate not in metrics:
        raise BadInput(f"evaluate.gate_metric: {gate!r} is not computed by the task (it gives {', '.join(metrics)})")
    if config.tracking.run_id:
        labels = _labels(task, model, split)
        _log(context, metrics, info.step, labels, info.uri,
             write_model=lambda path: save_model(config, info.uri, path, task=task, model=model))
    return EvaluateOutputs(metrics_json=json.dumps(metrics, sort_keys=True), passed=metrics[gate] >= config.evaluate.gate_min,
                           checkpoint_uri=info.uri, step=info.step)


def _split(context: Context, task):
    """The held-out split, streamed from the committed dataset (committed here first when the pipeline
    did not prepare one: a step run by hand)."""
    from .core.data import commit_task_data, open_split, own_dataset

    config, store = context.config, context.store
    version = config.data.version
    if version is None and not own_dataset(task):
        version = commit_task_data(task, store)[0].version
    return open_split(config, task, store, version, config.evaluate.split)


def _labels(task, model, split):
    """``(actual, predicted)`` labels for a classifier's confusion matrix (a task with ``predict`` and a
    ``y`` field), else None."""
    if not callable(getattr(task, "predict", None)) or split.manifest is None:
        return None
    names = [f["name"] for f in split.manifest.fields]
    if names != ["x", "y"]:
        return None
    arrays = split.arrays()
    return arrays["y"], task.predict(model, arrays["x"])


def _log(context: Context, metrics: dict, step: int, labels, checkpoint_uri: str,
         write_model) -> None:
    config = context.config
    client, run_id = context.tracker, config.tracking.run_id
    model_id = logged_model(config, checkpoint_uri, step, write_model)
    log_model_metrics(config, model_id, metrics, step, prefix=f"eval_{config.evaluate.split}_")
    call("tag the run", client.set_tag, run_id, "relaunch.evaluated_checkpoint", checkpoint_uri)
    with tempfile.TemporaryDirectory() as tmp:
        if labels is not None:  # what a classifier offers
            png = Path(tmp) / f"confusion_matrix_{config.evaluate.split}.png"
            confusion_png(*labels, png, title=f"{config.evaluate.split} split, step {step}")
            call("upload the confusion matrix", client.log_artifact, run_id, str(png), "evaluation")
        (Path(tmp) / "metrics.json").write_text(json.dumps({"step": step, "checkpoint_uri": checkpoint_uri, **metrics}, indent=2))
        call("upload the metrics", client.log_artifact, run_id, str(Path(tmp) / "metrics.json"), "evaluation")


def confusion_png(actual, predicted, path: Path, title: str) -> None:
    """Draw the confusion matrix of ``actual`` vs ``predicted`` labels into ``path`` (counts in
    each cell; numpy and matplotlib only: importing scikit-learn's metrics costs a second per run)."""
    import matplotlib
    import numpy as np

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    actual, predicted = np.asarray(actual), np.asarray(predicted)
    labels = np.unique(np.concatenate([actual, predicted]))
    index = {label: i for i, label in enumerate(labels.tolist())}
    counts = np.zeros((len(labels), len(labels)), dtype=int)
    np.add.at(counts, ([index[a] for a in actual.tolist()], [index[p] for p in predicted.tolist()]), 1)
    fig, ax = plt.subplots(figsize=(6, 6))
    ax.imshow(counts, cmap="viridis")
    for (row, col), n in np.ndenumerate(counts):
        ax.text(col, row, str(n), ha="center", va="center", color="black" if n > counts.max() / 2 else "white")
    ax.set_xticks(range(len(labels)), labels.tolist())
    ax.set_yticks(range(len(labels)), labels.tolist())
    ax.set_xlabel("Predicted label")
    ax.set_ylabel("True label")
    ax.set_title(title)
    fig.savefig(path, dpi=80, bbox_inches="tight")
    plt.close(fig)


if __name__ == "__main__":
    from .core.contract import steps
    from .core.runtime.stepcli import step_main

    sys.exit(step_main(steps.EVALUATE, run))
