"""Where a training starts: one decision, made by locate and by the trainer alike.

In order: the newest committed checkpoint of this training (a restarted pipeline continues where it
stopped), else ``train.resume_from`` (the whole training state), else the checkpoint behind
``train.warm_start_model`` (a registered model version: its weights only, training starts at step 0),
else nothing. The checkpoint named is checked in O(1) here (manifest, files, sizes, model); its bytes
are verified once, by the read that loads them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from components.core.checkpoint.layout import parse_checkpoint_uri
from components.core.contract.config import MODEL_URI
from components.core.contract.errors import BadInput, CorruptCheckpoint



@dataclasses.dataclass
class StartPoint:
    """What a training starts from: ``source`` is "latest", "resume_from", "warm_start" or "none"."""

    source: str
    uri: str
    step: int

    @property
    def weights_only(self) -> bool:
        """A warm start loads the model's weights, never optimizer, scheduler, step or RNG."""
        return self.source == "warm_start"


def start_point(config: Any, manager: Any, *, fingerprint: Callable[[], str] | None = None,
                warm_start_resolver: Callable[[Any], str] | None = None) -> StartPoint:
    """Decide where the training of ``config`` starts (collective under torch.distributed: rank 0
    decides, every rank gets the answer).

    ``resume_from`` equal to the warm-start model's checkpoint is a warm start: that is what a
    pipeline hands its launch step after locate chose the warm start.

    Raises:
        BadInput: ``resume_from`` is not a committed relaunch checkpoint or holds another model
            (``fingerprint`` gives this task's), the warm-start model version does not exist or has
            no checkpoint, or a checkpoint of a newer format.
    """
    latest = manager.latest()
    if latest is not None:
        return StartPoint("latest", latest.uri, latest.step)
    resolve = warm_start_resolver or warm_start_checkpoint
    return manager._agree(manager._rank0(lambda: _decide(config, fingerprint, resolve)))


def _decide(config: Any, fingerprint: Callable[[], str] | None, resolve: Callable[[Any], str]) -> StartPoint:
    train = config.train
    if train.resume_from and not train.warm_start_model:
        return StartPoint("resume_from", train.resume_from, checked_step(train.resume_from, fingerprint))
    if train.warm_start_model:
        uri = resolve(config)
        source = "warm_start" if not train.resume_from or _same(train.resume_from, uri) else "resume_from"
        if source == "resume_from":
            uri = train.resume_from
        return StartPoint(source, uri, checked_step(uri, fingerprint))
    return StartPoint("none", "", -1)


def _same(a: str, b: str) -> bool:
    try:
        return parse_checkpoint_uri(a) == parse_checkpoint_uri(b)
    except BadInput:
        return False


def checked_step(uri: str, fingerprint: Callable[[], str] | None = None) -> int:
    """The step of the committed checkpoint at ``uri``, after an O(1) check (manifest, files and
    sizes); with ``fingerprint``, also that it holds the model this task builds.

    Raises:
        BadInput: not a committed relaunch checkpoint (or unreadable), or another model.
    """
    from components.core.checkpoint.layout import read_manifest
    from components.core.checkpoint.verify import check_files
    from components.core.store import open_store

    store_uri, step = parse_checkpoint_uri(uri)
    store = open_store(store_uri)
    try:
        manifest = read_manifest(store, step)
        check_files(store, step, manifest)
    except (CorruptCheckpoint, FileNotFoundError) as err:
        raise BadInput(f"train.resume_from: {uri!r} is not a committed relaunch checkpoint ({err})") from None
    theirs = manifest.get("model_fingerprint")
    if fingerprint is not None and theirs:
        mine = fingerprint()
        if theirs != mine:
            raise BadInput(f"train.resume_from: {uri!r} holds another model (fingerprint {theirs}, the task "
                           f"builds {mine}); check train.task and its sizes")
    return step


def warm_start_checkpoint(config: Any) -> str:
    """The checkpoint URI recorded on the registered model version ``train.warm_start_model``.

    Raises:
        BadInput: not a models:/ URI, the model version or alias does not exist (the registry answers
            400/404), or it has no relaunch.checkpoint_uri tag.
        TransientFailure: the registry could not be reached (retryable).
    """
    from mlflow.exceptions import MlflowException

    from components.core.tracking.client import call, client as tracking_client, tracking_uri

    spec = config.train.warm_start_model or ""
    match = MODEL_URI.match(spec)  # the configuration model refused any other form at load time
    client = tracking_client(tracking_uri(config))
    name = match["name"]
    try:
        version = (client.get_model_version(name, match["version"]) if match["version"]
                   else client.get_model_version_by_alias(name, match["alias"]))
    except MlflowException as err:
        # RESOURCE_DOES_NOT_EXIST (404) or, for an unknown alias, INVALID_PARAMETER_VALUE (400): the
        # registry answered that there is no such version; anything else (5xx, 429) may pass
        if err.get_http_status_code() in (400, 404):
            raise BadInput(f"train.warm_start_model: {spec!r} does not exist in the registry") from None
        call(f"read model version {spec}", _raise, err)
        raise
    except Exception as err:  # noqa: BLE001 - a connection error: classified by the tracking contract
        call(f"read model version {spec}", _raise, err)
        raise
    uri = version.tags.get("relaunch.checkpoint_uri", "")
    if not uri:
        raise BadInput(f"train.warm_start_model: {spec!r} has no relaunch.checkpoint_uri tag; register it with relaunch")
    return uri


def _raise(err: BaseException) -> None:
    raise err
