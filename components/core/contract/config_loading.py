"""The configuration as a process is given it: the defaults, a YAML file (``--config FILE``) or JSON text
(``--config-json TEXT``), then ``--set dotted.key=value`` overrides, later ones winning, validated by the
model (:class:`relaunch.components.core.contract.config.RelaunchConfig`). Every refusal is one line
(:class:`~relaunch.components.core.contract.errors.BadInput`, exit code 2).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from .config import RelaunchConfig, describe_validation_error
from .errors import BadInput
from .uris import expand_home


def _parse_value(raw: str) -> Any:
    try:
        return yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        return raw


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``dotted.key=value`` strings (values parsed as YAML scalars/collections) to ``data``."""
    for item in overrides:
        if "=" not in item:
            raise BadInput(f"--set {item!r}: expected dotted.key=value, e.g. --set train.lr=0.1")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        if not all(parts):
            raise BadInput(f"--set {item!r}: empty key segment; expected dotted.key=value")
        node = data
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise BadInput(f"--set {item!r}: {part!r} is not a section")
            node = child
        node[parts[-1]] = _parse_value(raw)
    return data


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RelaunchConfig:
    """Build and validate the configuration.

    Args:
        path: a YAML file, or None for the defaults.
        overrides: ``dotted.key=value`` strings applied after the file.

    Raises:
        BadInput: unreadable file, invalid YAML, unknown key, wrong type or out-of-range value.
    """
    data: dict[str, Any] = {}
    if path is not None:
        try:
            p = Path(expand_home(str(path)))
        except ValueError as err:
            raise BadInput(f"config file {err}") from None
        try:
            loaded = yaml.safe_load(p.read_text())
        except FileNotFoundError:
            raise BadInput(f"config file {str(p)!r} does not exist") from None
        except yaml.YAMLError as err:
            raise BadInput(f"config file {str(p)!r} is not valid YAML: {str(err).splitlines()[0]}") from None
        except OSError as err:
            raise BadInput(f"config file {str(p)!r} cannot be read: {err.strerror}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise BadInput(f"config file {str(p)!r} must hold a mapping at the top, got {type(loaded).__name__}")
        data = loaded
    data = apply_overrides(data, list(overrides or []))
    try:
        return RelaunchConfig.model_validate(data)
    except ValidationError as err:
        raise BadInput(describe_validation_error(err)) from None


def config_from_cli(config: str | None, config_json: str | None, overrides: list[str] | None) -> RelaunchConfig:
    """What every step CLI does: ``--config FILE`` or ``--config-json TEXT``, then ``--set`` overrides."""
    if config_json:
        try:
            data = json.loads(config_json)
        except json.JSONDecodeError as err:
            raise BadInput(f"--config-json is not valid JSON: {err.msg} at position {err.pos}") from None
        data = apply_overrides(data, list(overrides or []))
        try:
            return RelaunchConfig.model_validate(data)
        except ValidationError as err:
            raise BadInput(describe_validation_error(err)) from None
    return load_config(config, overrides)
