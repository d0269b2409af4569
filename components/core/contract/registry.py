"""What the configuration validates against but the layers above it own: the store URI rules (the
store's :func:`~relaunch.components.core.store.parse_store_uri`) and the launch backends. The contract holds
the tables and the functions that fill them; nothing fills them when imported. One function fills them,
:func:`relaunch.components.core.runtime.wiring.wire`, and every entry point calls it first (each step's CLI,
the training worker, ``relaunch``, the KFP entry, the launchers' own commands, the tests' conftest), so
the contract never imports a layer above it and no import has a side effect on these tables
(``tests/test_house.py`` fails on a module whose import registers something here).
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
    _require_wired()
    return _store_uri_parsers[0](uri)


def wired() -> bool:
    """True once :func:`relaunch.components.core.runtime.wiring.wire` filled the tables of this process."""
    return bool(_store_uri_parsers) and bool(LAUNCH_BACKENDS)


def _require_wired() -> None:
    if not wired():
        raise RuntimeError("this process is not wired: its entry point must call "
                           "relaunch.components.core.runtime.wiring.wire() first")


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
"""The registered backends by name (:func:`register_launch_backend`, called by the wiring)."""


def register_launch_backend(name: str, module: str, *, cluster: bool = False, launches: bool = True,
                            renders: dict[str, str] | None = None, in_place: bool = False) -> LaunchBackend:
    """Register backend ``name``, implemented by ``module`` (its ``launch`` and render functions);
    ``renders`` maps each ``relaunch render`` kind it offers to the module's function that renders it;
    ``in_place``: it runs the in-place agent (``relaunch.components.launchers.inplace``) with ``train.memory_tier``."""
    backend = LaunchBackend(name, module, cluster, launches, dict(renders or {}), in_place)
    LAUNCH_BACKENDS[name] = backend
    return backend


def launch_backend_names() -> list[str]:
    """The names ``launch.backend`` accepts."""
    _require_wired()
    return [name for name, b in LAUNCH_BACKENDS.items() if b.launches]


def launch_backend(name: str) -> LaunchBackend:
    """The registered backend ``name`` (KeyError when there is none: the config refuses such a name first)."""
    _require_wired()
    return LAUNCH_BACKENDS[name]
