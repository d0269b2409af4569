"""Every key under ``runs/`` in the store, and the small JSON records kept there.

As :mod:`relaunch.components.core.checkpoint.layout` owns ``checkpoints/``, this module owns ``runs/``: a
key is spelled here and nowhere else, and the other modules read and write these records through
the helpers below. All keys are relative to the store root.

    runs/config.json                 the training's configuration (:func:`write_training_config`)
    runs/mlflow-run.json             the training's MLflow run (:func:`remember_run`, :func:`stored_run_id`)
    runs/attempts/attempt-<nnnn>.json one record per attempt (:mod:`relaunch.components.core.store.ledger`)
    runs/exit.json                   how the latest attempt ended under our control (:func:`write_exit_record`)
    runs/summary.json                the training summary (:func:`write_summary`, :func:`read_summary`)
    runs/metrics-pending.json        metric points (and outage tags) the tracking server had not confirmed
                                     at a checkpoint or when an attempt ended; sent by prepare and finalize
    runs/wandb-pending.json          W&B metric points its run's files may not hold yet at a checkpoint
                                     (:mod:`relaunch.components.core.tracking.wandb_tracker`)
    runs/injected/<kind>-step-<n>    a fault of ``launch.inject_failure`` that already fired
    runs/pipeline-finished.json      a pipeline of this training went through to its end (finalize)
    runs/pipeline-lock.json          the process running a pipeline of this training now
                                     (:mod:`relaunch.components.core.store.pipeline_lock`)
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

from ..contract.config import current_task_spec
from ..contract.errors import BadInput

RUNS_PREFIX = "runs/"
CONFIG_KEY = RUNS_PREFIX + "config.json"
RUN_KEY = RUNS_PREFIX + "mlflow-run.json"
ATTEMPTS_PREFIX = RUNS_PREFIX + "attempts/"
EXIT_KEY = RUNS_PREFIX + "exit.json"
SUMMARY_KEY = RUNS_PREFIX + "summary.json"
PENDING_METRICS_KEY = RUNS_PREFIX + "metrics-pending.json"
WANDB_PENDING_KEY = RUNS_PREFIX + "wandb-pending.json"
INJECTED_PREFIX = RUNS_PREFIX + "injected/"
PIPELINE_FINISHED_KEY = RUNS_PREFIX + "pipeline-finished.json"
PIPELINE_LOCK_KEY = RUNS_PREFIX + "pipeline-lock.json"


def attempt_key(n: int) -> str:
    """The record of attempt ``n`` (1-based): ``runs/attempts/attempt-0001.json``."""
    return f"{ATTEMPTS_PREFIX}attempt-{n:04d}.json"


def attempt_keys(store) -> list[str]:
    """The keys of every attempt record in ``store``, in order."""
    return sorted(k for k in store.list(ATTEMPTS_PREFIX) if k.endswith(".json"))


def injected_key(kind: str, step: int) -> str:
    """The marker an injected fault claims before it fires: ``runs/injected/<kind>-step-<n>``."""
    return f"{INJECTED_PREFIX}{kind}-step-{step}"


def read_json(store, key: str) -> Any:
    """The JSON value at ``key``, or None when there is none."""
    try:
        return json.loads(store.read_bytes(key))
    except FileNotFoundError:
        return None


def write_json(store, key: str, value: Any, *, indent: int | None = None) -> None:
    """Write ``value`` as JSON at ``key`` (values JSON cannot hold are written as strings)."""
    store.write_bytes(key, json.dumps(value, indent=indent, default=str).encode())


def write_json_if_absent(store, key: str, value: Any) -> bool:
    """Create ``key`` with ``value`` as JSON unless it exists; whether this call created it."""
    return store.write_if_absent(key, json.dumps(value).encode())


# ---- the training's configuration: what the training is

TRAINING_IDENTITY: tuple[str, ...] = (
    "train.task", "train.epochs", "train.max_steps", "train.global_batch_size", "train.hidden_size",
    "train.seed", "train.lr", "train.weight_decay", "train.parallelism", "train.mixed_precision", "train.amp",
    "train.deterministic", "train.warm_start_model", "train.resume_from", "train.task_options", "train.grad_clip_norm",
    "data.dataset", "data.version", "data.val_fraction", "data.test_fraction", "data.split_seed",
    "tracking.uri", "tracking.experiment", "launch.backend")
"""The configuration keys that say what a training is: its task, model, data, total steps and
optimisation (and where its MLflow run lives); ``relaunch run --resume`` refuses to change them. The
world size is not here: checkpoints are resharded on load (DDP and FSDP), so ``launch.nodes`` and
``launch.procs_per_node`` may change between attempts; every other key (logging, checkpoint cadence,
timeouts, evaluation and registry settings, an injected failure) may change too."""

_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/@\s]*@")


def _without_credentials(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_credentials(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_without_credentials(v) for v in value]
    if isinstance(value, str):
        return _USERINFO.sub(r"\g<scheme>", value)
    return value


def write_training_config(store, config: dict[str, Any]) -> dict[str, Any]:
    """Store ``config`` (a configuration as a dict) as the training's own unless one is stored
    already; the stored one. A user:password in any URI is dropped first: credentials come from the
    environment and are never stored."""
    record = _without_credentials(config)
    if write_json_if_absent(store, CONFIG_KEY, record):
        return record
    return read_training_config(store) or record


def read_training_config(store) -> dict[str, Any] | None:
    """The training's stored configuration (a dict), or None for a training that stored none
    (one started before relaunch stored it)."""
    return read_json(store, CONFIG_KEY)


def dotted(data: dict[str, Any], key: str) -> Any:
    """The value at ``key`` ("train.epochs") of a nested dict, or None when a section lacks it."""
    node: Any = data
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def identity_changes(stored: dict[str, Any], asked: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """``[(key, stored value, asked value)]`` for every :data:`TRAINING_IDENTITY` key that ``asked``
    (the keys a user gave explicitly, nested) sets to a value other than ``stored``'s."""
    changes = []
    for key in TRAINING_IDENTITY:
        new = dotted(asked, key)
        if new is None and not _sets(asked, key):
            continue
        old = dotted(stored, key)
        if key == "train.task":
            old, new = current_task_spec(old), current_task_spec(new)
        if new != old:
            changes.append((key, old, new))
    return changes



def refuse_resume_changes(changes: list[tuple[str, Any, Any]], stored_in: str, advice: str) -> None:
    """Raise the one line ``--resume`` prints when the command line changes what ``stored_in`` (e.g. "the
    training 2026...") keeps: the first change, the other keys, and ``advice``. Nothing when no change."""
    if not changes:
        return
    key, old, new = changes[0]
    more = f" (and {', '.join(k for k, _, _ in changes[1:])})" if len(changes) > 1 else ""
    raise BadInput(f"--resume: {key} is {json.dumps(old)} in {stored_in} and the command line asks for "
                   f"{json.dumps(new)}{more}; {advice}")

def refuse_another_identity(store, config: dict[str, Any]) -> None:
    """Refuse ``config`` (a whole configuration as a dict) when the training in ``store`` stored one
    that differs in a :data:`TRAINING_IDENTITY` key; store it as the training's own when it stored
    none. What a pipeline's prepare step does on a cluster, where the pipeline trains into
    ``store.uri`` itself and nothing else compares a resubmitted configuration with the stored one.
    Keys the stored configuration lacks (one written before they existed) are not compared.

    Raises:
        BadInput: one line naming the differing keys, both values of the first, and the way out.
    """
    stored = read_training_config(store)
    if stored is None:
        write_training_config(store, config)
        return
    asked = _without_credentials(config)
    changes = [(key, old, new) for key, old, new in identity_changes(stored, asked)
               if _sets(stored, key) and not (key == "data.version" and old is None)]  # None: prepare resolves it
    if changes:
        key, old, new = changes[0]
        more = f" (and {', '.join(k for k, _, _ in changes[1:])})" if len(changes) > 1 else ""
        raise BadInput(f"store.uri {store.uri} holds a training whose {key} is {json.dumps(old)}; this pipeline "
                       f"has {json.dumps(new)}{more}: a training keeps its configuration. Submit it with the "
                       f"stored values (runs/config.json), or point store.uri at a new folder to start a new "
                       f"training")


def _sets(data: dict[str, Any], key: str) -> bool:
    *sections, name = key.split(".")
    node: Any = data
    for part in sections:
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return isinstance(node, dict) and name in node


# ---- the training's MLflow run

def stored_run_id(store) -> str | None:
    """The MLflow run of the training in ``store``, or None when none is stored yet."""
    record = read_json(store, RUN_KEY)
    return record["run_id"] if record else None


def remember_run(store, run_id: str, *, tracking_uri: str, experiment: str) -> str:
    """Store ``run_id`` as the training's MLflow run unless one is stored already; the stored one."""
    record = {"run_id": run_id, "tracking_uri": tracking_uri, "experiment": experiment}
    if write_json_if_absent(store, RUN_KEY, record):
        return run_id
    return stored_run_id(store) or run_id


def replace_run(store, run_id: str, *, tracking_uri: str, experiment: str) -> None:
    """Store ``run_id`` as the training's MLflow run in place of the stored one (which is gone: a lost
    tracking database); the ids it replaces stay in the record, under ``previous_run_ids``."""
    old = read_json(store, RUN_KEY) or {}
    previous = [*old.get("previous_run_ids", []), *([old["run_id"]] if old.get("run_id") else [])]
    write_json(store, RUN_KEY, {"run_id": run_id, "tracking_uri": tracking_uri, "experiment": experiment,
                                "previous_run_ids": previous})


# ---- how attempts end

def write_exit_record(store, attempt: int, exit_code: int, reason: str, elastic_run_id: str = "") -> None:
    """How this attempt ended (rank 0, every ending under our control)."""
    write_json(store, EXIT_KEY, {"attempt": attempt, "exit_code": int(exit_code), "reason": reason,
                                 "time": time.time(), "elastic_run_id": elastic_run_id})


def read_exit_record(store) -> dict[str, Any] | None:
    """How the latest attempt ended under control, or None; what
    :func:`relaunch.components.core.contract.classify.torchrun_exit` reads."""
    return read_json(store, EXIT_KEY)


def write_summary(store, summary: dict[str, Any]) -> None:
    """The training summary (a :class:`relaunch.components.core.store.ledger.TrainSummary` as a dict)."""
    write_json(store, SUMMARY_KEY, summary, indent=2)


def read_summary(store) -> dict[str, Any] | None:
    """The last training summary written, or None."""
    return read_json(store, SUMMARY_KEY)


# ---- metric points not yet confirmed by the tracking server

def write_pending_metrics(store, through_step: int, points: list[list], tags: dict[str, str] | None = None,
                          status: str | None = None) -> None:
    """``points`` ([step, metrics] pairs) the tracking server had not confirmed at ``through_step``, and
    the ``tags`` (those of an outage) and run ``status`` it may not hold yet."""
    write_json(store, PENDING_METRICS_KEY, {"through_step": through_step, "points": points, "tags": tags or {},
                                            "status": status})


def read_pending_metrics(store) -> list[list]:
    """The pending [step, metrics] pairs an earlier attempt left ([] when none)."""
    return read_pending(store)["points"]


def read_pending(store) -> dict[str, Any]:
    """The whole pending record: ``points``, ``tags`` and ``status`` (None), empty when there is none."""
    record = read_json(store, PENDING_METRICS_KEY) or {}
    return {"points": record.get("points", []), "tags": record.get("tags", {}), "status": record.get("status")}


def write_wandb_pending(store, run: str, held: int, through_step: int, points: list[list]) -> None:
    """W&B run ``run``'s points ([step, metrics] pairs) of the steps after ``held`` (what its files held
    then) through ``through_step`` (the checkpoint being written): every one, logged or replayed."""
    write_json(store, WANDB_PENDING_KEY, {"run": run, "held": held, "through_step": through_step, "points": points})


def read_wandb_pending(store, run: str) -> dict[str, Any] | None:
    """The W&B pending record of run ``run`` (``held``, ``through_step``, ``points``), or None."""
    record = read_json(store, WANDB_PENDING_KEY)
    return record if isinstance(record, dict) and record.get("run") == run else None


# ---- the pipeline's end

def write_pipeline_finished(store, run_id: str, pipeline_run_id: str) -> None:
    """Record that a pipeline of MLflow run ``run_id`` went through to its end."""
    write_json(store, PIPELINE_FINISHED_KEY, {"run_id": run_id, "pipeline_run_id": pipeline_run_id,
                                              "time": time.time()})


def pipeline_finished(store, run_id: str | None) -> bool:
    """Whether a pipeline of MLflow run ``run_id`` went through to its end in ``store``."""
    record = read_json(store, PIPELINE_FINISHED_KEY)
    return record is not None and record.get("run_id") == run_id
