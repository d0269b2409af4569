"""Step 5, ``register``: a model version in the MLflow registry for the evaluated checkpoint.

The version is linked to the run and tagged with the checkpoint URI, the dataset version, the git
commit and the metrics; it gets the alias ``challenger``; ``champion`` moves to it only when its
``registry.champion_metric`` beats the current champion's by ``registry.champion_margin`` (else the
version's ``relaunch.champion_decision`` tag says why not). The checkpoint is pinned so retention
never deletes what a registered version points at. Runs only when evaluate's gate passed.

The version is made from the checkpoint's MLflow LoggedModel (the one evaluate made, else made here;
see :mod:`relaunch.components.core.tracking.lineage`), packaged by :mod:`relaunch.components.core.packaging.model`.

    python -m relaunch.components.register --config-json "$(cat resolved.json)" \\
        --input checkpoint_uri=... --input metrics_json='{"accuracy": 0.95}'
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from dataclasses import dataclass

from .core.checkpoint import CheckpointManager, parse_checkpoint_uri
from .core.contract.config import RelaunchConfig
from .core.contract.errors import BadInput
from .core.tracking.lineage import git_commit, logged_model, version_description
from .core.packaging.model import _load_pyfunc  # noqa: F401 - the loader_module of models saved before 0.2
from .core.packaging.model import save_model
from .core.store import open_store
from .core.tracking.client import call, tracking_uri
from .core.tracking.context import Context
from .core.tracking.wandb_tracker import record_registered_version

TAG = "relaunch."


@dataclass
class RegisterOutputs:
    model_name: str
    version: str
    aliases: str  # JSON list of the aliases this version holds
    champion_version: str
    champion_decision: str


def run(config: RelaunchConfig, checkpoint_uri: str, metrics_json: str) -> RegisterOutputs:
    """Register (or, on a retry, find) the version of ``checkpoint_uri`` and decide the aliases.

    Raises:
        BadInput: the metrics lack ``registry.champion_metric``, or there is no MLflow run.
    """
    metrics = json.loads(metrics_json)
    name, metric = config.registry.model_name, config.registry.champion_metric
    if metric not in metrics:
        raise BadInput(f"registry.champion_metric: {metric!r} is not among the metrics {sorted(metrics)}")
    if not config.tracking.run_id:
        raise BadInput("register: tracking.run_id is empty; run prepare first (it opens the MLflow run)")
    client = Context(config).tracker  # the step's one client; the pin below opens the checkpoint's own store
    version = _existing_version(client, config, checkpoint_uri)
    if version is None:
        model_id = logged_model(config, checkpoint_uri, _step(checkpoint_uri),
                                lambda path: save_model(config, checkpoint_uri, path))
        version = _register(client, config, checkpoint_uri, model_id, metrics)
    call("set alias challenger", client.set_registered_model_alias, name, "challenger", version)
    champion, decision = _decide_champion(client, config, version, float(metrics[metric]))
    call("tag the version", client.set_model_version_tag, name, version, TAG + "champion_decision", decision)
    _pin(checkpoint_uri, f"registered as {name} v{version}")
    record_registered_version(config, run_id=config.tracking.run_id, store_uri=config.store.uri, model_name=name, version=version)
    aliases = call("read the version", client.get_model_version, name, version).aliases
    return RegisterOutputs(model_name=name, version=version, aliases=json.dumps(sorted(aliases)),
                           champion_version=champion, champion_decision=decision)


def _existing_version(client, config: RelaunchConfig, checkpoint_uri: str) -> str | None:
    """The version already registered for this checkpoint (a retried register step, or a re-run of a
    finished training): one checkpoint, one version."""
    found = call("search model versions", client.search_model_versions, f"name = '{config.registry.model_name}'")
    return next((str(v.version) for v in sorted(found, key=lambda v: int(v.version))
                 if v.tags.get(TAG + "checkpoint_uri") == checkpoint_uri), None)


def _step(checkpoint_uri: str) -> int:
    return parse_checkpoint_uri(checkpoint_uri)[1]


def _register(client, config: RelaunchConfig, checkpoint_uri: str, model_id: str, metrics: dict) -> str:
    """A new version of ``registry.model_name`` made from the LoggedModel ``model_id``."""
    name, run_id = config.registry.model_name, config.tracking.run_id
    tags = {TAG + "checkpoint_uri": checkpoint_uri, TAG + "dataset_version": config.data.version or "",
            TAG + "git_commit": git_commit(), TAG + "task": config.train.task,
            **{f"{TAG}metric.{k}": str(v) for k, v in metrics.items()}}
    # the client, not mlflow.register_model: the fluent API would export MLFLOW_TRACKING_URI process-wide
    if not call("search registered models", client.search_registered_models, f"name = '{name}'"):
        try:
            client.create_registered_model(name, description="Registered by relaunch's register step.")
        except Exception:  # another pipeline created it first; the search below proves it exists
            call("read the registered model", client.get_registered_model, name)
    # source models:/<id> is what links the version to its LoggedModel (the registry stores no model_id)
    with _process_tracking_uri(tracking_uri(config)):
        version = call("register the model", client.create_model_version, name, f"models:/{model_id}",
                        run_id=run_id, tags=tags, model_id=model_id,
                        description=version_description(config, checkpoint_uri, _step(checkpoint_uri), metrics))
    _link_version_to_logged_model(client, model_id, name, str(version.version))
    return str(version.version)


def _link_version_to_logged_model(client, model_id: str, name: str, version: str) -> None:
    """The logged model's ``mlflow.modelVersions`` tag, as ``mlflow.register_model`` writes it: the
    UI's "Registered models" column of the run's logged models."""
    model = call("read the logged model", client.get_logged_model, model_id)
    versions = json.loads(model.tags.get("mlflow.modelVersions") or "[]")
    if {"name": name, "version": version} not in versions:
        call("tag the logged model", client.set_logged_model_tags, model_id,
              {"mlflow.modelVersions": json.dumps(versions + [{"name": name, "version": version}])})


@contextlib.contextmanager
def _process_tracking_uri(uri: str):
    """MLflow's database-backed registry resolves ``models:/<id>`` through the process-wide tracking
    URI, not the client's: set it for the call, then put back what was there (a server resolves it
    itself, so ``http(s)://`` needs nothing)."""
    if uri.startswith(("http://", "https://")):
        yield
        return
    import mlflow

    saved = mlflow.get_tracking_uri() if mlflow.is_tracking_uri_set() else None
    saved_env = os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(saved)  # None: unset again, as it was (it unsets MLFLOW_TRACKING_URI too)
        if saved_env is not None:
            os.environ["MLFLOW_TRACKING_URI"] = saved_env


def _decide_champion(client, config: RelaunchConfig, version: str, value: float) -> tuple[str, str]:
    """Move ``champion`` to ``version`` when it beats the current one by the margin; say why either way."""
    reg = config.registry
    current = _current_champion(client, reg.model_name)
    if current is not None and str(current.version) == version:
        return version, f"already champion ({reg.champion_metric}={value:g})"
    if current is not None:
        best = float(current.tags.get(f"{TAG}metric.{reg.champion_metric}", "nan"))
        better = value > best + reg.champion_margin if reg.champion_mode == "max" else value < best - reg.champion_margin
        if not better:
            return str(current.version), (f"not promoted: {reg.champion_metric}={value:g} does not beat champion "
                                          f"v{current.version}'s {best:g} by the margin {reg.champion_margin:g}")
        why = f"promoted: {reg.champion_metric}={value:g} beats v{current.version}'s {best:g} by more than {reg.champion_margin:g}"
    else:
        why = f"promoted: first version with {reg.champion_metric}={value:g}"
    call("set alias champion", client.set_registered_model_alias, reg.model_name, "champion", version)
    return version, why


def _current_champion(client, name: str):
    """The version holding ``champion``, or None when the model or the alias does not exist. Any
    other failure to read it (a 5xx, a lost connection) is retryable: guessing "no champion" would
    hand the alias to a model that may be worse."""
    def read():
        from mlflow.exceptions import MlflowException

        try:
            return client.get_registered_model(name)
        except MlflowException as err:
            if err.error_code == "RESOURCE_DOES_NOT_EXIST":
                return None
            raise

    model = call("read the registered model", read)
    if model is None or "champion" not in model.aliases:
        return None
    return call("read the champion", client.get_model_version, name, str(model.aliases["champion"]))


def _pin(checkpoint_uri: str, reason: str) -> None:
    store_uri, step = parse_checkpoint_uri(checkpoint_uri)
    with CheckpointManager(open_store(store_uri), async_save=False) as mgr:
        mgr.pin(step, reason)


if __name__ == "__main__":
    from .core.contract import steps
    from .core.runtime.stepcli import step_main

    sys.exit(step_main(steps.REGISTER, run))
