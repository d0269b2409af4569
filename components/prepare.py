"""Step 1, ``prepare``: build the task's data splits, store them under a content-addressed dataset
version (reused when it exists), open the MLflow run of this pipeline run, and hand every later step
the *resolved* configuration (``data.version`` and ``tracking.run_id`` filled in).

    python -m relaunch.components.prepare --config configs/local.yaml --input pipeline_run_id=manual

The typed pipeline parameters (``epochs``, ``nodes``, ...) arrive here as inputs and are folded into
the configuration: the value that means "keep the configuration's" is 0 for numbers and "" for text.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from typing import Any

from .core.checkpoint.layout import LEASE, read_json
from .core.checkpoint.write_lease import holder_alive
from .core.contract.config import RelaunchConfig
from .core.contract.pipeline_parameters import with_pipeline_parameters
from .core.contract.errors import BadInput, TransientFailure
from .core.store import open_store, probe_writable
from .core.store.conditional_probe import require_conditional_writes
from .core.store.records import refuse_another_identity, remember_run, stored_run_id
from .core.tracking import lineage
from .core.tracking.client import (call, check_api, ensure_run,
                                   log_new_params, reopen_run, tracking_uri)
from .core.tracking.context import Context
from .core.tracking.lineage import backend_params
from .core.tracking.mlflow_tracker import deliver_pending_metrics

@dataclass
class PrepareOutputs:
    config_json: str
    run_id: str
    dataset_version: str
    dataset_uri: str
    experiment_id: str


def run(config: RelaunchConfig, pipeline_run_id: str = "", **overrides: Any) -> PrepareOutputs:
    """Commit the task's dataset (or find it committed), open the MLflow run, return the resolved configuration.

    Args:
        config: the pipeline's configuration.
        pipeline_run_id: the orchestrator's run id; the MLflow run is found or created by it.
        **overrides: pipeline parameters named in :data:`~relaunch.components.core.contract.pipeline_parameters.PIPELINE_PARAMETERS`
            (0 or "" keeps the value).

    Raises:
        BadInput: an override, the task, the store or the tracking URI is wrong.
        TransientFailure: the store or tracking server could not be reached.
    """
    from .core.data import commit_task_data, dataset_uri
    from .tasks.base import load_task

    config = with_pipeline_parameters(config, overrides)
    task = load_task(config.train.task, config)
    context = Context(config)
    store = context.store
    probe_writable(store)  # the first write of a pipeline: a full or read-only store ends it here, exit 2
    _refuse_a_second_pipeline(store, pipeline_run_id)
    refuse_another_identity(store, json.loads(config.to_json()))
    manifest, written = commit_task_data(task, store)  # a task's own dataset: nothing to commit
    version = manifest.version if manifest is not None else ""
    if manifest is not None:
        print(f"prepare: dataset {version}: {manifest.samples('train')} training samples in "
              f"{len(manifest.split('train'))} shard(s); {written or 'nothing'} written", file=sys.stderr, flush=True)
    run_id = ensure_run(lineage.with_run_name(config, version), pipeline_run_id=pipeline_run_id or None)
    if config.tracking.run_id or pipeline_run_id:  # an existing run: a resume, a retried pipeline
        reopen_run(config, run_id)
    # what `relaunch run --resume` continues; the first one stays
    remember_run(store, run_id, tracking_uri=tracking_uri(config), experiment=config.tracking.experiment)
    resolved = config.model_copy(deep=True)
    resolved.data.version = version or None
    resolved.tracking.run_id = run_id
    _log_config(context.for_config(resolved))
    uri = dataset_uri(store, version) if version else ""
    if manifest is not None:
        lineage.log_dataset_input(resolved, run_id, manifest, uri)
    experiment_id = lineage.describe_run(resolved, run_id, version, uri)

    deliver_pending_metrics(resolved, store, run_id, who="prepare")  # a resume: what an outage left unsent
    return PrepareOutputs(config_json=resolved.to_json(), run_id=run_id, dataset_version=version, dataset_uri=uri,
                          experiment_id=experiment_id)


def _refuse_a_second_pipeline(store, pipeline_run_id: str) -> None:
    """Refuse, before this pipeline writes anything, a training whose checkpoint write lease a live
    writer of another pipeline holds (on a cluster: the same ``store.uri`` submitted twice). A holder
    of this training's own (a retry of this pipeline run, an orphan of its earlier attempt) is left to
    the lease, which waits for it."""
    record = read_json(store, LEASE)
    if not record or not holder_alive(record, collect=False):
        return
    ours = {os.environ.get("RELAUNCH_OWNER"), pipeline_run_id or None, f"run:{stored_run_id(store)}"}
    if record.get("owner") in ours:
        return
    raise BadInput(f"store.uri {store.uri} is being trained by {record.get('owner')!r} (host {record.get('host')}, "
                   f"pid {record.get('pid')}); one pipeline of a training at a time: wait for it to end or stop it, "
                   f"or point store.uri at a new folder to start another training")


def check_inputs(config: RelaunchConfig) -> None:
    """Refuse, before anything starts, what the pipeline would fail on later; writes nothing but a
    probe key it deletes.

    Checks the task imports, the store answers (bucket, credentials) and honours conditional writes,
    the tracking URI is usable, and ``train.resume_from`` names a committed checkpoint (the
    configuration model checked the syntax of every URI when it was loaded).

    Raises:
        BadInput: one line naming the field and what is wrong.
        TransientFailure: the tracking server answers /health but not its API (a line per try before).
    """
    from .tasks.base import load_task

    task = load_task(config.train.task, config)
    _check_world_sizes(config)
    _check_tracking(config)  # first: a tracking URI that is wrong must leave the store untouched too
    try:
        store = open_store(config.store.uri, retries=2, backoff=0.1)  # a probe: fewer, shorter retries
        probe_writable(store)  # full or read-only (StoreUnwritable): one line, before anything is written
        require_conditional_writes(store)
    except TransientFailure as err:
        raise BadInput(f"store.uri: {config.store.uri!r} cannot be reached ({err}); check AWS_ENDPOINT_URL") from None
    if config.train.resume_from:
        from .core.packaging.model import verify_checkpoint_uri

        verify_checkpoint_uri(config.train.resume_from, config, task)  # built once per process


def _check_world_sizes(config: RelaunchConfig) -> None:
    """Every world size the launch may reach (``min_nodes``..``nodes`` x ``procs_per_node``) must divide
    ``train.global_batch_size``; the trainer would refuse it only after the workers started."""
    launch, batch, micro = config.launch, config.train.global_batch_size, config.train.grad_accum_steps
    for nodes in range(launch.min_nodes or launch.nodes, launch.nodes + 1):
        world = nodes * launch.procs_per_node
        if batch % world:
            raise BadInput(f"train.global_batch_size={batch} is not divisible by the world size {world} "
                           f"({nodes} node(s) x launch.procs_per_node={launch.procs_per_node}); pick a multiple")
        if batch % (world * micro):
            raise BadInput(f"train.global_batch_size={batch} does not split into train.grad_accum_steps={micro} "
                           f"micro-batches on each of {world} ranks; pick a multiple of {world * micro}")


def _check_tracking(config: RelaunchConfig) -> None:
    import urllib.error
    import urllib.request
    from pathlib import Path

    uri = tracking_uri(config)
    if uri.startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=5):
                pass
            check_api(uri, config.tracking.experiment)  # /health may answer 200 while the API answers 500
        except urllib.error.HTTPError as err:
            if err.code in (401, 403):
                raise BadInput(f"tracking.uri: {uri} refused the credentials (HTTP {err.code}); "
                               "check MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD") from None
            raise BadInput(f"tracking.uri: {uri} answered HTTP {err.code} to /health; is it an MLflow server?") from None
        except (urllib.error.URLError, OSError) as err:
            reason = getattr(err, "reason", err)
            raise BadInput(f"tracking.uri: cannot reach the MLflow server at {uri} ({reason})") from None
    elif uri.startswith("sqlite:///"):
        parent = Path(uri.removeprefix("sqlite:///")).resolve().parent
        existing = next((p for p in (parent, *parent.parents) if p.exists()), None)
        if existing is None or not existing.is_dir() or not os.access(existing, os.W_OK):
            raise BadInput(f"tracking.uri: cannot create the MLflow database under {parent}")
    elif uri.startswith("postgresql"):
        import sqlalchemy

        try:
            with sqlalchemy.create_engine(uri, connect_args={"connect_timeout": 5}).connect():
                return
        except Exception as err:  # sqlalchemy/psycopg2 errors: unreachable host, bad credentials, no database
            first = str(err).splitlines()[0][:200]
            raise BadInput(f"tracking.uri: cannot connect to the tracking database ({first})") from None


def _log_config(context: Context) -> None:
    """The resolved configuration (``context.config``) as MLflow params (flattened) and a JSON artifact-free tag."""
    config, client = context.config, context.tracker
    flat = backend_params(_flatten(json.loads(config.to_json())), config.launch.backend)
    call("log params", log_new_params, client, config.tracking.run_id, flat)
    call("tag the run", client.set_tag, config.tracking.run_id, "relaunch.dataset_version", config.data.version)


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


if __name__ == "__main__":
    from .core.contract import steps
    from .core.runtime.stepcli import step_main

    sys.exit(step_main(steps.PREPARE, run))
