"""Step 2, ``locate-latest-checkpoint``: the checkpoint training starts from, or none.

In order: the newest committed checkpoint of this training (a restarted pipeline continues where it
stopped), else ``train.resume_from``, else the checkpoint behind ``train.warm_start_model`` (a
registered model version), else none (``checkpoint_uri=""``, ``step=-1``). Never cached: a cached
"latest checkpoint" is a wrong one.

    python -m components.locate --config configs/local.yaml
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from components.core.config import MODEL_URI, RelaunchConfig
from components.core.errors import BadInput


@dataclass
class LocateOutputs:
    checkpoint_uri: str
    step: int
    source: str  # "latest" | "resume_from" | "warm_start" | "none"


def run(config: RelaunchConfig) -> LocateOutputs:
    """Find the checkpoint to start from.

    Raises:
        BadInput: ``resume_from`` is not a committed relaunch checkpoint, or the warm-start model
            version does not exist or has no checkpoint.
    """
    latest = checkpoint_manager(config).latest()
    if latest is not None:
        return LocateOutputs(checkpoint_uri=latest.uri, step=latest.step, source="latest")
    if config.train.resume_from:
        return LocateOutputs(checkpoint_uri=config.train.resume_from,
                             step=verify_checkpoint_uri(config.train.resume_from, config), source="resume_from")
    if config.train.warm_start_model:
        uri = warm_start_checkpoint(config)
        return LocateOutputs(checkpoint_uri=uri, step=verify_checkpoint_uri(uri, config), source="warm_start")
    return LocateOutputs(checkpoint_uri="", step=-1, source="none")


def checkpoint_manager(config: RelaunchConfig, *, async_save: bool = False):
    """The CheckpointManager of this training's store, with the configuration's retention."""
    from components.core.checkpoint import CheckpointManager

    return CheckpointManager.from_config(config, async_save=async_save)


def verify_checkpoint_uri(uri: str, config: RelaunchConfig | None = None, task=None) -> int:
    """The step of the committed checkpoint at ``uri``; BadInput when it is not one of ours, or (with
    ``config``) when it holds another model than the task (``task``, or the configuration's) builds."""
    import json

    from components.core.checkpoint import MANIFEST, CheckpointManager, parse_checkpoint_uri, step_key
    from components.core.errors import CorruptCheckpoint

    store_uri, step = parse_checkpoint_uri(uri)
    mgr = CheckpointManager(store_uri, async_save=False)
    try:
        mgr.verify(step)
    except (CorruptCheckpoint, FileNotFoundError) as err:
        raise BadInput(f"train.resume_from: {uri!r} is not a committed relaunch checkpoint ({err})") from None
    if config is not None:
        from components.core.state import model_fingerprint
        from components.tasks.base import load_task

        theirs = json.loads(mgr.store.read_bytes(f"{step_key(step)}/{MANIFEST}")).get("model_fingerprint")
        mine = model_fingerprint((task or load_task(config.train.task, config)).build_model())
        if theirs and theirs != mine:
            raise BadInput(f"train.resume_from: {uri!r} holds another model (fingerprint {theirs}, the task "
                           f"builds {mine}); check train.task and its sizes")
    return step


def warm_start_checkpoint(config: RelaunchConfig) -> str:
    """The checkpoint URI recorded on the registered model version ``train.warm_start_model``."""
    from components.core.tracking import _call, _client, tracking_uri

    spec = config.train.warm_start_model or ""
    match = MODEL_URI.match(spec)  # the configuration model refused any other form at load time
    client = _client(tracking_uri(config))
    name = match["name"]
    try:
        version = (client.get_model_version(name, match["version"]) if match["version"]
                   else client.get_model_version_by_alias(name, match["alias"]))
    except Exception as err:  # MlflowException: not found, or the server is away (classified below)
        if "RESOURCE_DOES_NOT_EXIST" in str(err) or "not found" in str(err).lower():
            raise BadInput(f"train.warm_start_model: {spec!r} does not exist in the registry") from None
        _call(f"read model version {spec}", lambda: (_ for _ in ()).throw(err))
        raise
    uri = version.tags.get("relaunch.checkpoint_uri", "")
    if not uri:
        raise BadInput(f"train.warm_start_model: {spec!r} has no relaunch.checkpoint_uri tag; register it with relaunch")
    return uri


if __name__ == "__main__":
    from components.core.stepcli import step_main

    sys.exit(step_main("locate-latest-checkpoint", run))
