"""The study's MLflow run, the parent of its trials' runs: what a user expects of a sweep there. Its
params are the study's configuration (the space, sampler, seed, trials: logged by prepare, which opened
it); at the end it gets the best trial and value (tags and a metric), how many trials ended each way,
``study/trials.json`` (every trial's record) and two plots: the objective over the trials
(``study/objective.png``) and the parameters' importance (``study/importance.png``, Optuna's fANOVA).
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path
from typing import Any

from ..contract.config import RelaunchConfig
from ..tracking.client import call, client as tracking_client, tracking_uri
from .study_folder import COMPLETE, FAILED, PRUNED, TrialRecord

BEST_TRIAL_TAG = "relaunch.best_trial"
BEST_RUN_TAG = "relaunch.best_run_id"
BEST_VALUE_METRIC = "best_value"


def objective_png(records: list[TrialRecord | None], metric: str, direction: str, path: Path) -> None:
    """The objective of each complete trial by trial number, the best so far as a line, pruned trials at
    their last reported value (a cross) and failed ones on the axis (a red mark)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in records if r is not None]
    fig, ax = plt.subplots(figsize=(7, 4))
    complete = [r for r in done if r.state == COMPLETE and r.value is not None]
    ax.scatter([r.number for r in complete], [r.value for r in complete], color="tab:blue", zorder=3, label="complete")
    best, xs, ys = None, [], []
    for r in sorted(complete, key=lambda r: r.number):
        if best is None or (r.value < best if direction == "minimize" else r.value > best):
            best = r.value
        xs.append(r.number)
        ys.append(best)
    if xs:
        ax.step(xs, ys, where="post", color="tab:green", label="best so far")
    pruned = [r for r in done if r.state == PRUNED and r.value is not None]
    if pruned:
        ax.scatter([r.number for r in pruned], [r.value for r in pruned], marker="x", color="tab:orange", label="pruned")
    failed = [r for r in done if r.state == FAILED]
    if failed:
        low = min([r.value for r in complete] or [0.0])
        ax.scatter([r.number for r in failed], [low] * len(failed), marker="v", color="tab:red", label="failed")
    ax.set_xlabel("trial")
    ax.set_ylabel(metric)
    ax.set_xticks([r.number for r in done])
    ax.set_title(f"{metric} over the trials ({direction})")
    ax.legend(loc="best")
    fig.savefig(path, dpi=80, bbox_inches="tight")
    plt.close(fig)


def importance_png(importances: dict[str, float], path: Path) -> None:
    """A horizontal bar per parameter: its share of the objective's variance (fANOVA)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted(importances, key=importances.get)
    fig, ax = plt.subplots(figsize=(7, 1 + 0.5 * max(1, len(names))))
    ax.barh(names, [importances[n] for n in names], color="tab:blue")
    for y, name in enumerate(names):
        ax.text(importances[name], y, f" {importances[name]:.2f}", va="center")
    ax.set_xlim(0, 1.1)
    ax.set_xlabel("importance (share of the objective's variance, fANOVA)")
    ax.set_title("parameters' importance")
    fig.savefig(path, dpi=80, bbox_inches="tight")
    plt.close(fig)


def log_study(config: RelaunchConfig, run_id: str, records: list[TrialRecord | None], best: TrialRecord | None,
              importances: dict[str, float], extra_tags: dict[str, str] | None = None) -> None:
    """The study's end in its MLflow run ``run_id``: best trial, value and run (tags, and the value as
    the metric ``best_value``), counts per state, the trials' records and the two plots."""
    client = tracking_client(tracking_uri(config))
    metric, direction = config.tune.objective.metric, config.tune.objective.direction
    done = [r for r in records if r is not None]
    tags: dict[str, str] = {f"relaunch.trials_{state}": str(sum(r.state == state for r in done))
                            for state in (COMPLETE, PRUNED, FAILED)}
    tags.update(extra_tags or {})
    if best is not None:
        tags.update({BEST_TRIAL_TAG: str(best.number), BEST_RUN_TAG: best.run_id,
                     **{f"relaunch.best.{k}": str(v) for k, v in best.params.items()}})
        call("log the best value", client.log_metric, run_id, BEST_VALUE_METRIC, float(best.value))
        call("log the best value", client.log_metric, run_id, f"best_{metric}", float(best.value))
    for key, value in tags.items():
        call("tag the study's run", client.set_tag, run_id, key, value)
    for name, share in importances.items():
        call("log an importance", client.log_metric, run_id, f"importance/{name}", float(share))
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        table: list[dict[str, Any]] = [dataclasses.asdict(r) for r in done]
        (folder / "trials.json").write_text(json.dumps(table, indent=2, default=str))
        objective_png(records, metric, direction, folder / "objective.png")
        files = ["trials.json", "objective.png"]
        if importances:
            importance_png(importances, folder / "importance.png")
            files.append("importance.png")
        for name in files:
            call(f"upload {name}", client.log_artifact, run_id, str(folder / name), "study")
