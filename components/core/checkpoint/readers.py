"""Read leases: a checkpoint being read is never deleted under its reader (docs/checkpoint-format.md,
"Leases").

A reader writes ``checkpoints/readers/step-<012d>/<token>.json`` (``{"owner", "host", "pid",
"expires_at"}``, renewed by the manager's heartbeat) before it checks the step's manifest. Retention
writes ``checkpoints/readers/step-<012d>/DELETING.json`` before it lists that folder, and deletes the
step only when it finds no live read lease (and no pin) there. Each side writes first and reads the
other's record second, so on a store that reads its own and others' writes at once (a POSIX
filesystem; S3 since December 2020) at least one of the two sees the other: either retention keeps the
step, or the reader finds the marker (or the manifest already gone) and chooses again. A marker
counts only while the writer that wrote it still holds the write lease and is alive
(:func:`lease.holder_alive`): one left by a writer that died mid-retention does not block readers.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import uuid
from typing import Callable, TypeVar

from .layout import LEASE, PINS, PREFIX, now, parse_pin, read_json
from .write_lease import holder_alive
from ..contract.classify import is_store_unwritable
from ..contract.errors import BadInput, CorruptCheckpoint, RelaunchError
from ..store import PreconditionFailed, Store

T = TypeVar("T")

READERS = f"{PREFIX}/readers"
DELETING = "DELETING.json"


def readers_dir(step: int) -> str:
    """``checkpoints/readers/step-<012d>``: the read leases (and the deletion marker) of ``step``."""
    return f"{READERS}/step-{step:012d}"


def marker_key(step: int) -> str:
    return f"{readers_dir(step)}/{DELETING}"


def _expired(record: dict | None, at: float) -> bool:
    return not record or float(record.get("expires_at", 0) or 0) < at


def deletion_in_progress(store: Store, step: int, *, collect: bool = False) -> bool:
    """Whether a live writer marked ``step`` for deletion: the marker exists and its writer still
    holds the write lease (``collect``: see :func:`lease.holder_alive`)."""
    marker = read_json(store, marker_key(step))
    if marker is None:
        return False
    lease = read_json(store, LEASE)
    return bool(lease) and lease.get("token") == marker.get("token") and holder_alive(lease, collect=collect)


class ReadLeases:
    """The read leases one manager holds in one store (rank 0 only)."""

    def __init__(self, store: Store, owner: str, seconds: float):
        self.store, self.owner, self.seconds = store, owner, float(seconds)
        self.held: dict[int, str] = {}
        self.confirmed: set[int] = set()  # held steps that passed the handshake
        self.read_only = False
        self._lock = threading.RLock()

    def _body(self, step: int) -> bytes:
        return json.dumps({"step": step, "owner": self.owner, "host": socket.gethostname(), "pid": os.getpid(),
                           "created_at": now(), "expires_at": time.time() + self.seconds}).encode()

    def hold(self, step: int) -> None:
        """Write a read lease on ``step`` (if not held yet); nothing is checked: :meth:`acquire` does."""
        with self._lock:
            if step not in self.held and not self.read_only:
                key = f"{readers_dir(step)}/{uuid.uuid4().hex}.json"
                try:
                    _write(self.store, key, self._body(step))
                except (OSError, RelaunchError) as err:
                    if isinstance(err, PreconditionFailed) or not (
                            isinstance(err, (PermissionError, BadInput)) or is_store_unwritable(err)):
                        raise
                    # read-only credentials, a read-only or full store: read as before, unprotected
                    self.read_only = True
                    print(f"relaunch: cannot write a read lease in {self.store.uri} ({str(err).splitlines()[0][:120]}); "
                          f"reading without one: a writer's retention may delete what is read", file=sys.stderr,
                          flush=True)
                    return
                self.held[step] = key

    def acquire(self, step: int, check: Callable[[], T], *, wait: bool) -> T | None:
        """Lease ``step``, then make sure it is not being deleted, then return ``check()`` (the
        caller's check of its manifest and files, made under the lease, after the marker: a step
        deleted meanwhile has lost its manifest by the time its marker is gone).

        Without ``wait``, a step being deleted, or whose ``check`` raises CorruptCheckpoint or
        FileNotFoundError, gives None (the caller chooses another one) and its lease is dropped. With
        ``wait``, a deletion in progress is waited for (bounded by the lease time), then ``check``
        decides: a step that is gone raises as it would without any lease.
        """
        self.hold(step)
        try:
            if step not in self.confirmed:
                deadline = time.monotonic() + self.seconds
                while deletion_in_progress(self.store, step, collect=wait):
                    if not wait:
                        self.release(step)
                        return None
                    if time.monotonic() >= deadline:
                        break
                    time.sleep(min(0.5, self.seconds / 20))
            if wait:
                result = check()
            else:
                try:
                    result = check()
                except (CorruptCheckpoint, FileNotFoundError):
                    self.release(step)
                    return None
        except BaseException:
            self.release(step)
            raise
        self.confirmed.add(step)  # any later claim of retention lists this lease and keeps the step
        return result

    def renew(self) -> None:
        """Extend every lease held (the heartbeat)."""
        with self._lock:
            for step, key in list(self.held.items()):
                _write(self.store, key, self._body(step))

    def release(self, step: int) -> None:
        """Drop the lease of ``step`` (no error if not held or already gone)."""
        with self._lock:
            key = self.held.pop(step, None)
            self.confirmed.discard(step)
        if key is not None:
            try:
                self.store.delete(key)
            except (RelaunchError, OSError):
                pass  # it expires by itself

    def release_all(self) -> None:
        for step in list(self.held):
            self.release(step)


def claim_for_deletion(store: Store, step: int, *, token: str, seconds: float,
                       fence: Callable[[], None]) -> bool:
    """Retention's side of the handshake: after ``fence()`` (the writer still holds its lease),
    write the deletion marker of ``step``, then look for live read leases and pins of it. True: the
    step may be deleted (call :func:`deletion_done` after); False: it is kept, the marker removed.
    Expired read leases found on the way are removed."""
    fence()
    marker = marker_key(step)
    _write(store, marker, json.dumps({"step": step, "token": token, "created_at": now(),
                                      "expires_at": time.time() + seconds}).encode())
    try:
        live = False
        at = time.time()
        for key in store.list(readers_dir(step) + "/"):
            if key == marker:
                continue
            if _expired(read_json(store, key), at):
                store.delete(key)  # a reader that died (or a lease dropped in between)
            else:
                live = True
        if not live:
            live = any((p := parse_pin(k)) is not None and p[0] == step for k in store.list(PINS + "/"))
    except BaseException:
        _drop(store, marker)  # nothing was deleted: readers need not wait for this step
        raise
    if live:
        store.delete(marker)
    return not live


def _write(store: Store, key: str, body: bytes) -> None:
    """``store.write_bytes``, again when a filesystem store's folder was pruned under it: a reader
    and retention add and remove files of the same folder at once (the store removes folders it
    empties)."""
    for attempt in range(5):
        try:
            store.write_bytes(key, body)
            return
        except (FileExistsError, FileNotFoundError):
            if attempt == 4:
                raise


def _drop(store: Store, key: str) -> None:
    try:
        store.delete(key)
    except (RelaunchError, OSError):
        pass


def deletion_done(store: Store, step: int) -> None:
    """Remove the marker once ``step`` is deleted (a reader that sees neither finds no manifest)."""
    store.delete(marker_key(step))
