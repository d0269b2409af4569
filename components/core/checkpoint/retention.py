"""Which checkpoints to delete after a commit (docs/checkpoint-format.md, "Retention").

Only intact committed checkpoints count toward ``keep_last`` and compete for ``keep_best``: a
damaged one (quarantined, or found damaged by the O(1) check that ``manifest`` runs) is neither
counted nor deleted; it stays for inspection until its step is written again (docs, "Quarantine").
"""

from __future__ import annotations

from typing import Any, Callable

from .layout import LATEST, MANIFEST, PINS, PREFIX, STEP_DIR, parse_pin, read_json, step_key
from .quarantine import marker_step
from ..contract.errors import BadInput, CorruptCheckpoint
from ..store import Store


# (step, the keys of its directory, the quarantine markers) -> the step's checked manifest
Listed = Callable[[int, set[str], set[str]], dict[str, Any]]


class Retention:
    """The retention policy of one store: which committed checkpoints to keep after a commit.

    Args:
        store: the store whose ``checkpoints/`` it prunes.
        keep_last: intact committed checkpoints kept by recency; 0 keeps every checkpoint.
        keep_best: intact checkpoints kept by ``best_metric`` (ties: the newer step wins).
        best_metric, mode: the metric ``keep_best`` ranks by, and ``"min"`` or ``"max"``.

    Raises:
        BadInput: a mode other than min/max, ``keep_best`` without a metric, a negative count.
    """

    def __init__(self, store: Store, *, keep_last: int = 3, keep_best: int = 0, best_metric: str | None = None,
                 mode: str = "min"):
        self.check(keep_last=keep_last, keep_best=keep_best, best_metric=best_metric, mode=mode)
        self.store = store
        self.keep_last, self.keep_best, self.best_metric, self.mode = keep_last, keep_best, best_metric, mode

    @staticmethod
    def check(*, keep_last: int, keep_best: int, best_metric: str | None, mode: str) -> None:
        """Refuse a policy that cannot be applied (before any store is opened).

        Raises:
            BadInput: a mode other than min/max, ``keep_best`` without a metric, a negative count.
        """
        if mode not in ("min", "max"):
            raise BadInput(f"checkpoint mode {mode!r} must be 'min' or 'max'")
        if keep_best and not best_metric:
            raise BadInput("keep_best needs best_metric (the metric name to rank checkpoints by)")
        if keep_last < 0 or keep_best < 0:
            raise BadInput(f"keep_last ({keep_last}) and keep_best ({keep_best}) must be >= 0")

    def apply(self, *, in_flight: int | None, manifest: Callable[[int], dict[str, Any]],
              claim: Callable[[int], bool] | None = None, done: Callable[[int], None] | None = None,
              listed: Listed | None = None) -> list[int]:
        """Delete what the policy does not keep (:func:`apply_retention`); returns the deleted steps."""
        return apply_retention(self.store, keep_last=self.keep_last, keep_best=self.keep_best,
                               best_metric=self.best_metric, mode=self.mode, in_flight=in_flight,
                               manifest=manifest, claim=claim, done=done, listed=listed)


def apply_retention(store: Store, *, keep_last: int, keep_best: int, best_metric: str | None, mode: str,
                    in_flight: int | None, manifest: Callable[[int], dict[str, Any]],
                    claim: Callable[[int], bool] | None = None,
                    done: Callable[[int], None] | None = None, listed: Listed | None = None) -> list[int]:
    """Delete every step directory that is not kept: the last ``keep_last`` intact committed (0:
    all committed), the best ``keep_best`` intact by ``best_metric``, the step latest.json names,
    pinned steps, ``in_flight`` and damaged (quarantined) checkpoints. ``manifest(step)`` returns
    the manifest of an intact committed checkpoint or raises CorruptCheckpoint (and records the
    damage). A committed directory loses its manifest first, so a crash mid-way leaves uncommitted
    debris.

    ``claim(step)`` runs right before a step is deleted (the writer's fence and the read-lease
    handshake, :mod:`readers`): False keeps the step; ``done(step)`` runs after its deletion.
    ``listed(step, keys, markers)``, when given, replaces ``manifest(step)`` with what this listing
    shows: the keys of the step's directory and every quarantine marker (a writer's remembered
    manifests, :meth:`Locator.retained`, are then not read again). Returns the deleted steps."""
    dirs: dict[int, set[str]] = {}
    pinned: set[int] = set()
    marked: set[int] = set()
    markers: set[str] = set()
    for k in store.list(PREFIX + "/"):
        parts = k.split("/")
        if len(parts) >= 3 and (m := STEP_DIR.match(parts[1])):
            dirs.setdefault(int(m.group(1)), set()).add(k)
        elif k.startswith(PINS + "/") and (p := parse_pin(k)):
            pinned.add(p[0])
        elif (q := marker_step(k)) is not None:
            marked.add(q)
            markers.add(k)
    committed = sorted(s for s, ks in dirs.items() if f"{step_key(s)}/{MANIFEST}" in ks)
    manifests: dict[int, dict[str, Any]] = {}
    damaged: set[int] = set()

    def intact(s: int) -> bool:
        if s not in manifests and s not in damaged:
            try:
                manifests[s] = manifest(s) if listed is None else listed(s, dirs[s], markers)
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
