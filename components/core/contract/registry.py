"""What the configuration validates against but the layers above it own: the store URI rules
(registered by :mod:`relaunch.components.core.store`, one per backend) and the launch backends (registered by
:mod:`relaunch.components.launchers`). The contract holds the tables; the owners fill them when imported, and
the package root (``components/__init__.py``) imports both owners, so every entry point validates a
configuration against the full tables while no module of the contract imports a layer above it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

StoreUriParser = Callable[[str], tuple[str, str, str]]

_store_uri_parsers: list[StoreUriParser] = []


def register_store_uri_parser(parse: StoreUriParser) -> None:
    """Make ``parse`` the rule :func:`parse_store_uri` applies (the store package registers its own)."""
    _store_uri_parsers[:] = [parse]


def parse_store_uri(uri: str) -> tuple[str, str, str]:
    """Split a store URI into ``(scheme, location, prefix)`` (``("file", path, "")``, ``("s3", bucket,
    prefix)``, ...) by the registered store's rules: the one set of rules the configuration and
    :func:`relaunch.components.core.store.open_store` apply.

    Raises:
        ValueError: one line saying what is wrong and how to write it.
    """
    if not _store_uri_parsers:
        raise RuntimeError("no store URI rules registered: import relaunch.components.core.store first")
    return _store_uri_parsers[0](uri)


@dataclass(frozen=True)
class LaunchBackend:
    """One registered launch backend."""

    name: str
    module: str  # the dotted module that implements it
    cluster: bool = False  # runs as a Kubernetes job (the pipeline's exit handler deletes it on failure)
    launches: bool = True  # ``launch.backend`` may name it; False: it only renders (slurm)
    renders: dict[str, str] = field(default_factory=dict)  # ``relaunch render`` kind -> function of the module
    in_place: bool = False  # runs the in-place agent with ``train.memory_tier`` (else: its own restarts)


LAUNCH_BACKENDS: dict[str, LaunchBackend] = {}
"""The registered backends by name (:func:`relaunch.components.launchers.register_launch_backend`)."""


def launch_backend_names() -> list[str]:
    """The names ``launch.backend`` accepts."""
    return [name for name, b in LAUNCH_BACKENDS.items() if b.launches]


def launch_backend(name: str) -> LaunchBackend:
    """The registered backend ``name`` (KeyError when there is none: the config refuses such a name first)."""
    return LAUNCH_BACKENDS[name]
