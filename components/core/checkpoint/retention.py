"""Which checkpoints to delete after a commit (docs/checkpoint-format.md, "Retention")."""

from __future__ import annotations

from typing import Any, Callable

from components.core.checkpoint.layout import LATEST, MANIFEST, PINS, PREFIX, STEP_DIR, parse_pin, read_json, step_key
from components.core.errors import CorruptCheckpoint
from components.core.storage import Store


def apply_retention(store: Store, *, keep_last: int, keep_best: int, best_metric: str | None, mode: str,
                    in_flight: int | None, manifest: Callable[[int], dict[str, Any]],
                    claim: Callable[[int], bool] | None = None,
                    done: Callable[[int], None] | None = None) -> list[int]:
    """Delete every step directory that is not kept: the last ``keep_last`` committed (0: all), the
    best ``keep_best`` by ``best_metric``, the step latest.json names, pinned steps and ``in_flight``.
    A committed directory loses its manifest first, so a crash mid-way leaves uncommitted debris.

    ``claim(step)`` runs right before a step is deleted (the writer's fence and the read-lease
    handshake, :mod:`readers`): False keeps the step; ``done(step)`` runs after its deletion.
    Returns the deleted steps."""
    dirs: dict[int, set[str]] = {}
    pinned: set[int] = set()
    for k in store.list(PREFIX + "/"):
        parts = k.split("/")
        if len(parts) >= 3 and (m := STEP_DIR.match(parts[1])):
            dirs.setdefault(int(m.group(1)), set()).add(k)
        elif k.startswith(PINS + "/") and (p := parse_pin(k)):
            pinned.add(p[0])
    committed = sorted(s for s, ks in dirs.items() if f"{step_key(s)}/{MANIFEST}" in ks)
    keep = set(committed[-keep_last:]) if keep_last > 0 else set(committed)
    keep |= pinned
    if in_flight is not None:
        keep.add(in_flight)
    latest = read_json(store, LATEST)
    if latest and isinstance(latest.get("step"), int):
        keep.add(latest["step"])
    if keep_best and best_metric:
        scored = []
        for s in committed:
            try:
                value = manifest(s).get("metrics", {}).get(best_metric)
            except (CorruptCheckpoint, FileNotFoundError):
                continue
            if value is not None:
                scored.append((float(value) if mode == "min" else -float(value), -s))
        keep |= {-neg for _, neg in sorted(scored)[:keep_best]}
    deleted = []
    for s in sorted(dirs):
        if s in keep:
            continue
        if claim is not None and not claim(s):
            continue
        key = f"{step_key(s)}/{MANIFEST}"
        if key in dirs[s]:
            store.delete(key)  # uncommit first: a crash from here leaves plain debris
        store.delete_many(sorted(dirs[s] - {key}))
        if done is not None:
            done(s)
        deleted.append(s)
    return deleted
