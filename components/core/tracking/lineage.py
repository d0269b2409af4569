"""MLflow 3 lineage of a training: what a person sees in the MLflow UI besides the metrics.

- the run's name (pipeline name + the training's folder name, unless ``tracking.run_name`` is set),
  MLflow's own source/git/user tags, a run description that says what the pipeline does and, at
  the end, what it did, and the experiment's description and kind ("Model training" view);
- the prepared dataset as a run input (``mlflow.data``: name, digest = the content-addressed
  version, source = the store URI);
- each checkpoint evaluate or register uses as a LoggedModel (``step=``, linked to the run as an
  output, its metrics logged with its ``model_id``); the registered version is made from it;
- the params that apply to the chosen launch backend, and the link that opens the run.

Every call goes through the tracking module's error contract (credentials -> BadInput, anything
else -> TransientFailure); reading is idempotent, so a retried step finds what it made before.
"""

from __future__ import annotations

import getpass
import os
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

from ..contract.errors import BadInput
from ..store.azure import wasbs_uri

EXPERIMENT_KIND = "custom_model_development"  # MLflow 3's "Model training" experiment kind
DESCRIPTION_TAG = "mlflow.note.content"  # the run's / experiment's description in the UI
CHECKPOINT_TAG = "relaunch.checkpoint_uri"
MODEL_TYPE = "relaunch-checkpoint"
OUTCOME = "**Outcome:"  # where finalize's part of the run description begins
DATASET_CONTEXT = "training"


# -------------------------------------------------------------------------------------------------
# the run: name, source tags, descriptions, link


TRAININGS = "trainings"  # ``relaunch run``'s namespace of trainings in the store: <store>/trainings/<id>


def training_id(config) -> str | None:
    """The training's folder name when its store is ``<root>/trainings/<id>`` (``relaunch run``), else None."""
    parent, _, name = config.store.uri.rstrip("/").rpartition("/")
    return name if name and parent.rstrip("/").rpartition("/")[2] == TRAININGS else None


def run_name(config, dataset_version: str = "", started: float | None = None) -> str:
    """``tracking.run_name`` when set, else ``<pipeline>-<training id>``: the training's folder name
    (its UTC start time, ``trainings/20261204-025830``), so the run list tells trainings apart and each
    run names its folder; a store outside ``trainings/`` gives the UTC start time the same way. The
    dataset version is not in the name: it is the same for every training of the same data (it is
    the run's dataset input and its ``relaunch.dataset_version`` tag)."""
    if config.tracking.run_name:
        return config.tracking.run_name
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(started if started is not None else time.time()))
    return f"{config.name}-{training_id(config) or stamp}"


def version_description(config, checkpoint_uri: str, step: int, metrics: dict[str, Any]) -> str:
    """A registered model version's description: the training it came from (id and MLflow run), the
    step, the dataset version, the evaluation metrics and the checkpoint URI it was made from."""
    scores = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in sorted(metrics.items()))
    training = training_id(config) or config.tracking.run_name or "?"
    return (f"Training `{training}` (MLflow run `{config.tracking.run_id}`) at step {step}, trained on dataset "
            f"`{config.data.dataset}` version `{config.data.version or '?'}`; evaluated on the "
            f"{config.evaluate.split} split: {scores or 'no metrics'}. Checkpoint: {checkpoint_uri}")


def with_run_name(config, dataset_version: str):
    """A copy of ``config`` whose ``tracking.run_name`` is :func:`run_name` (for creating the run)."""
    named = config.model_copy(deep=True)
    named.tracking.run_name = run_name(config, dataset_version)
    return named


def git_commit() -> str:
    """``RELAUNCH_GIT_COMMIT`` (set in images), else the checkout's HEAD, else "unknown"."""
    return os.environ.get("RELAUNCH_GIT_COMMIT") or _git("rev-parse", "HEAD") or "unknown"


def _git(*args: str) -> str:
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def source_tags(config) -> dict[str, str]:
    """MLflow's own ``mlflow.source.*`` / ``mlflow.user`` tags: the UI's Source and Created by."""
    tags = {
        "mlflow.source.type": "JOB",
        "mlflow.source.name": f"relaunch pipeline {config.name!r} ({config.launch.backend})",
        "mlflow.source.git.commit": git_commit(),
        "mlflow.user": os.environ.get("RELAUNCH_USER") or _user(),
    }
    if repo := os.environ.get("RELAUNCH_GIT_REPO") or _git("config", "--get", "remote.origin.url"):
        tags["mlflow.source.git.repoURL"] = repo
    if branch := _git("rev-parse", "--abbrev-ref", "HEAD"):
        tags["mlflow.source.git.branch"] = branch
    return tags


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no passwd entry for the uid (containers)
        return "unknown"


def plan_description(config, dataset_version: str, dataset_uri: str) -> str:
    """The run description prepare writes: what this pipeline run is going to do."""
    t, launch, ev, reg = config.train, config.launch, config.evaluate, config.registry
    length = f"{t.max_steps} steps" if t.max_steps else f"{t.epochs} epoch(s)"
    return (f"relaunch pipeline **{config.name}**: trains `{t.task}` on dataset `{config.data.dataset}` "
            f"version `{dataset_version}` ({dataset_uri}) for {length} on {launch.nodes} node(s) x "
            f"{launch.procs_per_node} process(es) ({launch.backend} backend), checkpointing to {config.store.uri}; "
            f"evaluates the {ev.checkpoint} committed checkpoint on the {ev.split} split and registers it as "
            f"`{reg.model_name}` when {ev.gate_metric} >= {ev.gate_min:g}.")


def outcome_description(config, run, status: str, summary: dict | None, versions: list) -> str:
    """What the pipeline did, appended to the plan by finalize."""
    lines = [f"{OUTCOME} {status}.**"]
    if summary:
        resumed = [s for s in summary.get("resumed_from_steps", []) if s >= 0]
        restarts = max(0, int(summary.get("attempts", 1)) - 1)
        lines.append(f"Trained to step {summary.get('last_step')} of {summary.get('total_steps')} in "
                     f"{summary.get('attempts')} attempt(s), {restarts} restart(s)"
                     + (f", resumed from step(s) {', '.join(map(str, resumed))}" if resumed else "") + ".")
    evaluated = run.data.tags.get("relaunch.evaluated_checkpoint")
    prefix = f"eval_{config.evaluate.split}_"
    scores = ", ".join(f"{k.removeprefix(prefix)}={v:.4g}" for k, v in sorted(run.data.metrics.items())
                       if k.startswith(prefix))
    if evaluated:
        lines.append(f"Evaluated {evaluated}" + (f": {scores}." if scores else "."))
    for v in versions:
        aliases = ", ".join(sorted(getattr(v, "aliases", []) or [])) or "no alias"
        lines.append(f"Registered `{v.name}` version {v.version} ({aliases}).")
    return "\n\n".join(lines)


def describe_run(config, run_id: str, dataset_version: str, dataset_uri: str) -> str:
    """Source tags and the plan as the run's description; the experiment's description and kind
    when it has none. Idempotent (a retried prepare writes the same). Returns the run's experiment id."""
    from mlflow.entities import RunTag

    from .client import call, client as tracking_client, tracking_uri

    client = tracking_client(tracking_uri(config))
    run = call("read the run", client.get_run, run_id)
    outcome = run.data.tags.get(DESCRIPTION_TAG, "").partition(OUTCOME)[1:]  # kept until finalize rewrites it
    description = plan_description(config, dataset_version, dataset_uri) + ("\n\n" + "".join(outcome) if outcome[0] else "")
    tags = {**source_tags(config), DESCRIPTION_TAG: description}
    call("tag the run", client.log_batch, run_id, tags=[RunTag(k, v) for k, v in tags.items()])
    experiment = call("read the experiment", client.get_experiment, run.info.experiment_id)
    if DESCRIPTION_TAG not in experiment.tags:
        call("describe the experiment", client.set_experiment_tag, experiment.experiment_id, DESCRIPTION_TAG,
              f"Trainings of relaunch pipeline **{config.name}**: one run per training, every attempt of it "
              f"(restarts, retries) logged into that run; models registered as `{config.registry.model_name}`.")
    if "mlflow.experimentKind" not in experiment.tags:
        call("set the experiment kind", client.set_experiment_tag, experiment.experiment_id,
              "mlflow.experimentKind", EXPERIMENT_KIND)
    return experiment.experiment_id


def describe_outcome(context, run_id: str, status: str) -> None:
    """Append what the pipeline did to the run's description (finalize); ``context`` is the training's
    :class:`~relaunch.components.core.tracking.context.Context`."""
    from .client import call

    client = context.tracker
    run = call("read the run", client.get_run, run_id)
    plan = run.data.tags.get(DESCRIPTION_TAG, "").partition(OUTCOME)[0].strip()
    versions = call("search model versions", client.search_model_versions, f"run_id = '{run_id}'")
    versions = [call("read the version", client.get_model_version, v.name, v.version) for v in versions]
    text = outcome_description(context.config, run, status, _training_summary(context), versions)
    call("describe the run", client.set_tag, run_id, DESCRIPTION_TAG, f"{plan}\n\n{text}".strip())


def record_attempts(context, run_id: str) -> None:
    """The attempts' summary tags (count, restarts, last exit code), ``relaunch/attempts.json`` and
    ``relaunch/checkpoints.json``, from the store's attempt records. Each attempt's trainer writes them for the attempts before it, but one
    SIGKILLed with no attempt after it (its rank 0 killed, restarts and retries spent) leaves them to
    the side that survives: finalize. ``context`` is the training's
    :class:`~relaunch.components.core.tracking.context.Context`; its store is opened here when it was not."""
    from mlflow.entities import RunTag

    from ..store import ledger
    from .client import call
    from .mlflow_tracker import (ATTEMPTS_ARTIFACT, CHECKPOINTS_ARTIFACT, attempt_summary_tags,
                                 attempts_table, checkpoint_history)

    store = context.store
    attempts = ledger.load_attempts(store)
    if not attempts:  # the pipeline stopped before training
        return
    client = context.tracker
    tags = [RunTag(k, v) for k, v in attempt_summary_tags(attempts).items()]
    call("tag the attempts", client.log_batch, run_id, tags=tags)
    call("log the attempts", client.log_dict, run_id, attempts_table(attempts), ATTEMPTS_ARTIFACT)
    call("log the checkpoints", client.log_dict, run_id, checkpoint_history(store, attempts), CHECKPOINTS_ARTIFACT)


def _training_summary(context) -> dict | None:
    from ..store.records import read_summary

    try:
        return read_summary(context.store)
    except FileNotFoundError:  # the pipeline stopped before training
        return None


def run_url(config, run_id: str, experiment_id: str) -> str:
    """The run's page in MLflow 3's "Model training" view: the server's own address for an
    ``http(s)://`` tracking URI, else ``make ui``'s http://127.0.0.1:5000; the experiments list when
    the experiment is not known."""
    from .client import tracking_uri

    uri = tracking_uri(config)
    base = uri.rstrip("/") if uri.startswith(("http://", "https://")) else "http://127.0.0.1:5000"
    if not experiment_id:
        return f"{base}/#/experiments?workflowType=machine_learning"
    return f"{base}/#/experiments/{experiment_id}/runs/{run_id}?workflowType=machine_learning"


# -------------------------------------------------------------------------------------------------
# params of the chosen backend


BACKEND_SECTIONS = {
    "launch.kubernetes.": {"kubernetes", "pytorchjob", "trainjob"},
    "launch.trainjob.": {"trainjob"},
}
"""Param prefix -> the launch backends it applies to; params outside these apply to every backend."""


def backend_params(flat: dict[str, Any], backend: str) -> dict[str, Any]:
    """``flat`` without the params that only other launch backends read."""
    return {k: v for k, v in flat.items()
            if all(backend in users for prefix, users in BACKEND_SECTIONS.items() if k.startswith(prefix))}


# -------------------------------------------------------------------------------------------------
# the dataset


def log_dataset_input(config, run_id: str, manifest, uri: str) -> None:
    """The prepared dataset as a run input (context ``training``); MLflow keeps one per digest (the
    version). Its schema is the train split's fields; its profile counts the samples and shards of
    every split (the data stays in the store: nothing of it is read here)."""
    import json

    import mlflow.data
    import numpy as np
    from mlflow.entities import Dataset, DatasetInput, InputTag

    from .client import call, client as tracking_client, tracking_uri

    if uri.startswith("az://"):  # MLflow resolves Azure dataset sources by their wasbs:// name only
        uri = wasbs_uri(uri)
    empty = {f["name"]: np.zeros((0, *f["shape"]), dtype=np.dtype(f["dtype"])) for f in manifest.fields}
    described = dataset_entity(mlflow.data.from_numpy(empty, source=uri, name=config.data.dataset,
                                                      digest=manifest.version))
    profile = {"num_rows": manifest.samples("train"),
               "splits": {name: {"samples": sum(s.samples for s in shards), "shards": len(shards),
                                 "bytes": sum(s.bytes for s in shards)} for name, shards in sorted(manifest.splits.items())}}
    entity = DatasetInput(Dataset(name=described.name, digest=described.digest, source_type=described.source_type,
                                  source=described.source, schema=described.schema, profile=json.dumps(profile)),
                          tags=[InputTag("mlflow.data.context", DATASET_CONTEXT)])
    client = tracking_client(tracking_uri(config))
    call("log the dataset input", client.log_inputs, run_id, datasets=[entity])


def dataset_entity(dataset):
    """The ``mlflow.entities.Dataset`` that MLflow logs for the ``mlflow.data`` dataset ``dataset``,
    built from its public ``to_dict`` (name, digest, source type, source JSON, schema, profile)."""
    from mlflow.entities import Dataset

    fields = dataset.to_dict()
    return Dataset(name=fields["name"], digest=fields["digest"], source_type=fields["source_type"],
                   source=fields["source"], schema=fields.get("schema"), profile=fields.get("profile"))


# -------------------------------------------------------------------------------------------------
# checkpoints as LoggedModels


def logged_model(config, checkpoint_uri: str, step: int, write_model: Callable[[Path], None]) -> str:
    """The id of the LoggedModel of ``checkpoint_uri`` in this run: found, or created with
    ``write_model(folder)``'s MLflow model directory as its artifacts and linked to the run as an
    output at ``step``.

    Raises:
        BadInput: no MLflow run (``tracking.run_id`` empty) or refused credentials.
        TransientFailure: the tracking server could not be reached.
    """
    import tempfile

    from mlflow.entities import LoggedModelOutput, LoggedModelStatus

    from .client import call, client as tracking_client, tracking_uri

    run_id = config.tracking.run_id
    if not run_id:
        raise BadInput("tracking.run_id is empty; run prepare first (it opens the MLflow run)")
    client = tracking_client(tracking_uri(config))
    found = find_logged_model(config, checkpoint_uri)
    if found is not None and str(found.status) == str(LoggedModelStatus.READY):
        return found.model_id
    if found is None:
        experiment_id = call("read the run", client.get_run, run_id).info.experiment_id
        found = call("create the logged model", client.create_logged_model, experiment_id,
                      name=checkpoint_uri.rstrip("/").rsplit("/", 1)[-1], source_run_id=run_id,
                      tags={CHECKPOINT_TAG: checkpoint_uri, "relaunch.dataset_version": config.data.version or "",
                            "relaunch.task": config.train.task, "relaunch.git_commit": git_commit()},
                      params={"step": str(step), "task": config.train.task}, model_type=MODEL_TYPE)
    with tempfile.TemporaryDirectory() as tmp:
        write_model(Path(tmp) / "model")
        call("upload the logged model", client.log_model_artifacts, found.model_id, str(Path(tmp) / "model"))
    call("link the model to the run", client.log_outputs, run_id, [LoggedModelOutput(found.model_id, step=step)])
    call("finalize the logged model", client.finalize_logged_model, found.model_id, LoggedModelStatus.READY)
    return found.model_id


def find_logged_model(config, checkpoint_uri: str):
    """The LoggedModel this run made of ``checkpoint_uri`` (READY ones first), or None."""
    from .client import call, client as tracking_client, tracking_uri

    client = tracking_client(tracking_uri(config))
    run = call("read the run", client.get_run, config.tracking.run_id)
    found = call("search logged models", client.search_logged_models, [run.info.experiment_id],
                  filter_string=f"source_run_id = '{config.tracking.run_id}'")
    mine = [m for m in found if m.tags.get(CHECKPOINT_TAG) == checkpoint_uri]
    mine.sort(key=lambda m: (str(m.status) != "READY", m.creation_timestamp))
    return mine[0] if mine else None


def log_model_metrics(config, model_id: str, metrics: dict[str, float], step: int, prefix: str = "") -> None:
    """Log ``metrics`` to the run linked to ``model_id`` and to the dataset input."""
    from mlflow.entities import Metric

    from .client import call, client as tracking_client, tracking_uri

    now = int(time.time() * 1000)
    linked = {"model_id": model_id}
    if config.data.version:
        linked.update(dataset_name=config.data.dataset, dataset_digest=config.data.version)
    client = tracking_client(tracking_uri(config))
    call("log the model's metrics", client.log_batch, config.tracking.run_id,
          metrics=[Metric(prefix + k, float(v), now, step, **linked) for k, v in metrics.items()])
