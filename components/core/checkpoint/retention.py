"""Which checkpoints to delete after a commit (docs/checkpoint-format.md, "Retention").

Only intact committed checkpoints count toward ``keep_last`` and compete for ``keep_best``: a
damaged one (quarantined, or found damaged by the O(1) check that ``manifest`` runs) is neither
counted nor deleted; it stays for inspection until its step is written again (docs, "Quarantine").
"""

from __future__ import annotations

from typing import Any, Callable

from components.core.checkpoint.layout import LATEST, MANIFEST, PINS, PREFIX, STEP_DIR, parse_pin, read_json, step_key
from components.core.checkpoint.quarantine import marker_step
from components.core.contract.errors import CorruptCheckpoint
from components.core.store import Store


def apply_retention(store: Store, *, keep_last: int, keep_best: int, best_metric: str | None, mode: str,
                    in_flight: int | None, manifest: Callable[[int], dict[str, Any]],
                    claim: Callable[[int], bool] | None = None,
                    done: Callable[[int], None] | None = None) -> list[int]:
    """Delete every step directory that is not kept: the last ``keep_last`` intact committed (0:
    all committed), the best ``keep_best`` intact by ``best_metric``, the step latest.json names,
    pinned steps, ``in_flight`` and damaged (quarantined) checkpoints. ``manifest(step)`` returns
    the manifest of an intact committed checkpoint or raises CorruptCheckpoint (and records the
    damage). A committed directory loses its manifest first, so a crash mid-way leaves uncommitted
    debris.

    ``claim(step)`` runs right before a step is deleted (the writer's fence and the read-lease
    handshake, :mod:`readers`): False keeps the step; ``done(step)`` runs after its deletion.
    Returns the deleted steps."""
    dirs: dict[int, set[str]] = {}
    pinned: set[int] = set()
    marked: set[int] = set()
    for k in store.list(PREFIX + "/"):
        parts = k.split("/")
        if len(parts) >= 3 and (m := STEP_DIR.match(parts[1])):
            dirs.setdefault(int(m.group(1)), set()).add(k)
        elif k.startswith(PINS + "/") and (p := parse_pin(k)):
            pinned.add(p[0])
        elif (q := marker_step(k)) is not None:
            marked.add(q)
    committed = sorted(s for s, ks in dirs.items() if f"{step_key(s)}/{MANIFEST}" in ks)
    manifests: dict[int, dict[str, Any]] = {}
    damaged: set[int] = set()

    def intact(s: int) -> bool:
        if s not in manifests and s not in damaged:
            try:
                manifests[s] = manifest(s)
            except (CorruptCheckpoint, FileNotFoundError):
                damaged.add(s)
        return s in manifests

    if keep_last > 0:
        keep: set[int] = set()
        for s in reversed(committed):  # newest first, until keep_last intact ones are found
            if len(keep) >= keep_last:
                break
            if intact(s):
                keep.add(s)
    else:
        keep = set(committed)
    keep |= pinned | damaged | (marked & set(committed))  # a damaged checkpoint stays for inspection
    if in_flight is not None:
        keep.add(in_flight)
    latest = read_json(store, LATEST)
    if latest and isinstance(latest.get("step"), int):
        keep.add(latest["step"])
    if keep_best and best_metric:
        scored = []
        for s in committed:
            if not intact(s):
                continue
            value = manifests[s].get("metrics", {}).get(best_metric)
            if value is not None:
                scored.append((float(value) if mode == "min" else -float(value), -s))
        keep |= {-neg for _, neg in sorted(scored)[:keep_best]}
    keep |= damaged  # found by the keep_best pass
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
