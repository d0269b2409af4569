"""The registry's side of a warm start: the checkpoint behind ``train.warm_start_model``.

The start-point rule (:mod:`relaunch.components.core.recovery.start`) looks it up here when
``train.warm_start_model`` is set.
"""

from __future__ import annotations

from typing import Any

from ..contract.uris import MODEL_URI
from ..contract.errors import BadInput
from . import client as tracking


def warm_start_checkpoint(config: Any) -> str:
    """The checkpoint URI recorded on the registered model version ``train.warm_start_model``.

    Raises:
        BadInput: not a models:/ URI, the model version or alias does not exist (the registry answers
            400/404), or it has no relaunch.checkpoint_uri tag.
        TransientFailure: the registry could not be reached (retryable).
    """
    from mlflow.exceptions import MlflowException  # mlflow only where a warm start is asked for

    spec = config.train.warm_start_model or ""
    match = MODEL_URI.match(spec)  # the configuration model refused any other form at load time
    registry = tracking.client(tracking.tracking_uri(config))
    name = match["name"]
    try:
        version = (registry.get_model_version(name, match["version"]) if match["version"]
                   else registry.get_model_version_by_alias(name, match["alias"]))
    except MlflowException as err:
        # RESOURCE_DOES_NOT_EXIST (404) or, for an unknown alias, INVALID_PARAMETER_VALUE (400): the
        # registry answered that there is no such version; anything else (5xx, 429) may pass
        if err.get_http_status_code() in (400, 404):
            raise BadInput(f"train.warm_start_model: {spec!r} does not exist in the registry") from None
        tracking.call(f"read model version {spec}", _raise, err)
        raise
    except Exception as err:  # noqa: BLE001 - a connection error: classified by the tracking contract
        tracking.call(f"read model version {spec}", _raise, err)
        raise
    uri = version.tags.get("relaunch.checkpoint_uri", "")
    if not uri:
        raise BadInput(f"train.warm_start_model: {spec!r} has no relaunch.checkpoint_uri tag; register it with relaunch")
    return uri


def _raise(err: BaseException) -> None:
    raise err
