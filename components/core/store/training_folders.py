"""The trainings of a store root: ``relaunch run`` gives each training its own namespace
``<store.uri>/trainings/<UTC start time>/`` (dataset, checkpoints, ``runs/`` records); a cluster
pipeline uses ``store.uri`` itself. The inspection commands (``relaunch checkpoints``,
``python -m relaunch.components.locate`` by hand) find a training from the root with these helpers.
"""

from __future__ import annotations

import difflib

from ..contract.errors import BadInput
from . import Store, join_uri

TRAININGS = "trainings"
"""The folder under a store root that holds one folder per training."""


def training_names(store: Store) -> list[str]:
    """The trainings under ``store`` (``trainings/<name>/``), oldest first: their names sort by start time."""
    return sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in store.list(f"{TRAININGS}/", recursive=False)
                  if e.endswith("/"))


def training_uri(root: str, name: str) -> str:
    """The store URI of training ``name`` under the store root ``root``."""
    return join_uri(root, f"{TRAININGS}/{name}")


def holds_checkpoints(store: Store) -> bool:
    """Whether ``store`` has a ``checkpoints/`` folder of its own (it is a training, not a root of trainings)."""
    return bool(store.list("checkpoints/", recursive=False))


def pick_training(store: Store, name: str, option: str = "--training") -> str:
    """The URI of training ``name`` of the root ``store``.

    Raises:
        BadInput: no such training (the line names the ones there are, and the nearest).
    """
    names = training_names(store)
    if name in names:
        return training_uri(store.uri, name)
    if not names:
        raise BadInput(f"{option} {name!r}: {store.uri} holds no trainings (trainings/<time>/); "
                       f"leave {option} out to read the store itself")
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}? " if close else ""
    shown = ", ".join(names[-5:]) + (f" (and {len(names) - 5} older)" if len(names) > 5 else "")
    raise BadInput(f"{option} {name!r}: no such training in {store.uri}; {hint}its trainings, newest last: {shown}")


def resolve_trainings(store: Store) -> list[tuple[str | None, str]]:
    """``[(name, uri), ...]`` of what ``store`` holds: its trainings, oldest first, when it is a root
    of trainings without checkpoints of its own; else ``[(None, store.uri)]``, the store itself."""
    names = training_names(store)
    if names and not holds_checkpoints(store):
        return [(n, training_uri(store.uri, n)) for n in names]
    return [(None, store.uri)]
