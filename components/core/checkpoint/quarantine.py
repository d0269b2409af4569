"""Damaged checkpoints: recorded once in the store, never chosen again, their step writable again.

A committed checkpoint found damaged (a file missing or of another size, a chunk that does not match
its digest, a manifest that does not parse or does not match its own digest) is *quarantined*: a
marker ``checkpoints/quarantine/step-<012d>-<sha16>.json`` records the step, the sha256 of the
manifest found damaged (its first 16 hex digits name the marker), the reason, when and by whom. Any
process that finds the damage may write it (a reader too): it is created with ``write_if_absent``,
so nothing is ever overwritten and two finders agree. The marker is bound to that manifest: a step
written again later has another manifest, which the old marker does not cover.

The writer (the lease holder) that saves a quarantined step again first moves the old checkpoint
aside (:func:`move_aside`) to ``checkpoints/quarantine/step-<012d>-<id>/`` with the record as
``QUARANTINE.json``: on a filesystem one rename of the directory (the bytes are kept for
inspection); on S3, which has no rename, the record and a copy of the manifest are written there,
then the step's manifest is deleted first (uncommitted from then on) and its other files after (see
docs/checkpoint-format.md, "Quarantine"). Nothing deletes quarantined data on its own; a person
removes a marker or a folder under ``checkpoints/quarantine/`` when done with it.
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
import uuid
from typing import Any

from .layout import MANIFEST, QUARANTINE, now, read_json, step_key
from ..contract.errors import RelaunchError
from ..store import FileStore, Store

RECORD = "QUARANTINE.json"
MARKER = re.compile(r"^step-(\d{12})-([0-9a-f]{16})\.json$")
MOVED = re.compile(r"^step-(\d{12})-([0-9a-f]{8,32})$")


def marker_key(step: int, manifest_sha256: str) -> str:
    """The marker of checkpoint ``step`` whose manifest bytes have this sha256."""
    return f"{QUARANTINE}/step-{step:012d}-{manifest_sha256[:16]}.json"


def marker_step(key: str) -> int | None:
    """The step a key under ``checkpoints/`` is a quarantine marker of, else None."""
    head, _, name = key.rpartition("/")
    m = MARKER.match(name)
    return int(m.group(1)) if m and head == QUARANTINE else None


def find(store: Store, step: int, manifest_sha256: str) -> dict[str, Any] | None:
    """The record of checkpoint ``step`` (this manifest) if it is quarantined, else None.
    A marker that is not a JSON object still quarantines: it was written on purpose."""
    try:
        raw = store.read_bytes(marker_key(step, manifest_sha256))  # one request, absent or not
    except FileNotFoundError:
        return None
    try:
        record = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        record = None
    return record if isinstance(record, dict) else {"step": step, "manifest_sha256": manifest_sha256,
                                                    "reason": "unreadable marker"}


def record(store: Store, step: int, manifest_sha256: str, reason: str, found_by: str) -> bool:
    """Quarantine checkpoint ``step`` (whose manifest bytes have ``manifest_sha256``); True when this
    call wrote the marker. Best effort: a store that refuses the write (read-only credentials, an
    outage) is reported on stderr and the caller goes on; the damage is found again next time."""
    body = {"step": step, "manifest_sha256": manifest_sha256, "reason": reason, "found_at": now(),
            "found_by": found_by, "host": socket.gethostname(), "pid": os.getpid()}
    try:
        wrote = store.write_if_absent(marker_key(step, manifest_sha256),
                                      json.dumps(body, sort_keys=True).encode())
    except (OSError, RelaunchError) as err:
        print(f"relaunch: could not record checkpoint {store.uri_for(step_key(step))} as damaged ({err})",
              file=sys.stderr, flush=True)
        return False
    if wrote:
        print(f"relaunch: checkpoint {store.uri_for(step_key(step))} quarantined: {reason}",
              file=sys.stderr, flush=True)
    return wrote


def records(store: Store) -> list[dict[str, Any]]:
    """Every quarantine record, by step: markers of checkpoints still in place (``"moved_to": None``)
    and folders of checkpoints moved aside (``"moved_to"``: the folder's URI)."""
    out: list[dict[str, Any]] = []
    for entry in store.list(QUARANTINE + "/", recursive=False):
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        if entry.endswith("/") and (m := MOVED.match(name)):
            rec = read_json(store, f"{QUARANTINE}/{name}/{RECORD}") or {"reason": "no record"}
            out.append({**rec, "step": int(m.group(1)), "moved_to": store.uri_for(f"{QUARANTINE}/{name}")})
        elif (m := MARKER.match(name)):
            rec = read_json(store, entry) or {"reason": "unreadable marker"}
            out.append({**rec, "step": int(m.group(1)), "moved_to": None})
    return sorted(out, key=lambda r: (r["step"], r["moved_to"] is None, str(r.get("found_at", ""))))


def move_aside(store: Store, step: int, rec: dict[str, Any], moved_by: str) -> str:
    """Move the checkpoint of ``step`` out of the way of a new save of that step; returns the key of
    the folder that holds what was kept. Called by the lease holder only. Afterwards the step has no
    directory and no marker: a save writes it from scratch and nothing of the old one is reused."""
    key = step_key(step)
    dest = f"{QUARANTINE}/step-{step:012d}-{uuid.uuid4().hex[:12]}"
    rec = {**rec, "moved_at": now(), "moved_by": moved_by, "moved_to": store.uri_for(dest)}
    body = json.dumps(rec, sort_keys=True).encode()
    if isinstance(store, FileStore) or callable(getattr(store, "path", None)):  # a filesystem (or a wrapper of one)
        # the record travels with the directory; a reader ignores files its manifest does not list
        store.write_bytes(f"{key}/{RECORD}", body)
        target = store.path(dest)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.rename(store.path(key), target)  # one atomic step: the step is gone, uncommitted, at once
        for directory in (store.path(key).parent, target.parent):
            fd = os.open(directory, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    else:
        # no rename on S3: keep the record and the manifest, uncommit, then delete the data
        sizes = store.sizes(key)
        store.write_bytes(f"{dest}/{RECORD}", json.dumps(
            {**rec, "files": {k.rsplit("/", 1)[-1]: n for k, n in sizes.items()}}, sort_keys=True).encode())
        try:
            store.write_bytes(f"{dest}/{MANIFEST}", store.read_bytes(f"{key}/{MANIFEST}"))
        except FileNotFoundError:
            pass
        store.delete(f"{key}/{MANIFEST}")
        store.delete_many(sorted(k for k in store.list(key + "/") if k != f"{key}/{MANIFEST}"))
    for marker in store.list(QUARANTINE + "/", recursive=False):
        if marker_step(marker) == step:
            store.delete(marker)
    return dest


__all__ = ["RECORD", "find", "marker_key", "marker_step", "move_aside", "record", "records"]
