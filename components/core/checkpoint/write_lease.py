"""The single-writer lease of a store (``checkpoints/LEASE.json``): a training started twice never
interleaves two histories (docs/checkpoint-format.md, "Leases").

Taken before the training starts, by conditional create (or by a conditional overwrite of a lease
that may be taken over), renewed by a heartbeat (If-Match on the ETag last written) and checked the
same way right before every commit and every deletion (:meth:`Lease.fence`): a writer that lost its
lease raises :class:`LeaseLost` there and writes nothing more.

Who may take a lease another holder wrote (:meth:`Lease.take`):

- anyone, once its ``expires_at`` has passed (the holder stopped renewing: dead, or stalled);
- at once, a later torchelastic attempt of the same elastic run (``TORCHELASTIC_RUN_ID`` equal,
  ``TORCHELASTIC_RESTART_COUNT`` higher): the agent stopped the previous workers before it started
  this one;
- at once, a process on the same host and pid namespace when the holder's pid is gone (in this
  very process: when no live lease object holds the token any more, or the holder is another
  manager of the same owner, which is fenced from then on);
- otherwise the same owner (an orphan still running beside a ``--resume``, a pipeline retry whose
  pod is not gone yet) waits, bounded by ``wait_seconds``, for the holder to release or stop
  renewing, and another owner is refused at once; both refusals are one line, exit 2.
"""

from __future__ import annotations

import datetime as _dt
import gc
import json
import os
import socket
import sys
import threading
import time
import uuid
import weakref

from .layout import LEASE, now, read_json, write_conditional
from ..contract import events
from ..contract.errors import BadInput, RelaunchError
from ..store import PreconditionFailed, Store
from ..store.holder import on_this_host, pid_namespace, process_running
from ..store.conditional_probe import require_conditional_writes

_LIVE: "weakref.WeakValueDictionary[str, Lease]" = weakref.WeakValueDictionary()  # token -> held lease


WAIT_LINE_SECONDS = 5.0
"""While :meth:`Lease.take` waits for a live holder: a line when it starts waiting, then one this often."""


def _say_waiting(current: dict, refusal: str, deadline: float, *, first: bool) -> None:
    """One line on what the lease waits for and for how long at most: on stderr, and as a ``waiting``
    event for ``relaunch run``'s console (the event file it names, when it names one)."""
    left = max(0.0, deadline - time.monotonic())
    expires = max(0.0, float(current.get("expires_at", 0) or 0) - time.time())
    line = (f"{'waiting' if first else 'still waiting'} for the write lease: {refusal.split(';')[0]}; it expires in "
            f"{expires:.0f}s unless renewed, waiting at most {left:.0f}s more")
    print(f"relaunch: {line}", file=sys.stderr, flush=True)
    events.write(events.Kind.WAITING, line=line)


class LeaseLost(BadInput):
    """This writer's lease was taken over (it stalled for longer than ``lease_seconds``): it must
    neither commit nor delete anything."""


def default_owner() -> str:
    """$RELAUNCH_OWNER, the pipeline run id or $TORCHELASTIC_RUN_ID, else host:pid."""
    for name in ("RELAUNCH_OWNER", "RELAUNCH_PIPELINE_RUN_ID", "TORCHELASTIC_RUN_ID"):
        if os.environ.get(name):
            return os.environ[name]
    return f"{socket.gethostname()}:{os.getpid()}"


def holder_alive(record: dict | None, *, collect: bool = True) -> bool:
    """Whether the writer of lease ``record`` may still be writing: its lease has not expired and,
    when it ran on this host (same pid namespace), its process is still there (in this very process:
    its lease object is still reachable; ``collect``: after a garbage collection, which finds a
    manager dropped after a failure)."""
    if not record or float(record.get("expires_at", 0) or 0) < time.time():
        return False
    pid = record.get("pid")
    if not on_this_host(record):
        return True
    if pid != os.getpid():
        return process_running(pid)
    if collect and record.get("token") in _LIVE:
        gc.collect()  # a manager dropped after a failure may only be unreachable, not yet freed
    return record.get("token") in _LIVE


def _restart_count() -> int:
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    except ValueError:
        return 0


class Lease:
    """The write lease of ``store`` held (or not yet) by ``owner``.

    Args:
        store: the checkpoint store.
        owner: the logical writer (one training; stable across its restarts).
        seconds: how long the lease lasts without a renewal.
        wait_seconds: how long :meth:`take` waits for a live holder of the same owner (default:
            ``seconds``, long enough for a dead holder's lease to expire).
    """

    def __init__(self, store: Store, owner: str, seconds: float, *, wait_seconds: float | None = None):
        self.store, self.owner, self.seconds = store, owner, float(seconds)
        self.wait_seconds = self.seconds if wait_seconds is None else float(wait_seconds)
        self.token = uuid.uuid4().hex
        self.etag: str | None = None
        self.lost: LeaseLost | None = None
        self._acquired_at = ""
        self._lock = threading.RLock()  # the heartbeat and the commit's fence renew from two threads

    @property
    def held(self) -> bool:
        return self.etag is not None and self.lost is None

    def _body(self) -> bytes:
        return json.dumps({"owner": self.owner, "token": self.token, "host": socket.gethostname(),
                           "pid": os.getpid(), "pid_namespace": pid_namespace(),
                           "elastic_run_id": os.environ.get("TORCHELASTIC_RUN_ID", ""),
                           "restart_count": _restart_count(), "acquired_at": self._acquired_at or now(),
                           "expires_at": time.time() + self.seconds}).encode()

    def take(self) -> None:
        """Take the lease (see the module's rules), or renew it when held.

        Raises:
            BadInput: another owner holds a live lease, or the same owner's live holder did not let
                go within ``wait_seconds``.
            LeaseLost: this lease was held and has been taken over.
        """
        with self._lock:
            if self.etag is not None:
                self.renew()
                return
            require_conditional_writes(self.store)
            self._acquired_at = now()
            deadline = time.monotonic() + self.wait_seconds
            told = 0.0  # time.monotonic() of the last line said about the wait (0: none yet)
            while True:
                if self.store.write_if_absent(LEASE, self._body()):
                    self._held_as(self.store.etag(LEASE))
                    return
                etag = self.store.etag(LEASE)
                current = read_json(self.store, LEASE) or {}
                if etag is None:
                    continue  # released in between: create it
                refusal = self._refusal(current)
                if refusal is None:
                    try:
                        self._held_as(write_conditional(self.store, LEASE, self._body(), if_match=etag))
                        return
                    except (PreconditionFailed, FileNotFoundError):
                        continue  # someone else moved first: judge the new lease
                if current.get("owner") != self.owner or time.monotonic() >= deadline:
                    raise BadInput(refusal)
                if time.monotonic() - told >= WAIT_LINE_SECONDS:
                    _say_waiting(current, refusal, deadline, first=not told)
                    told = time.monotonic()
                time.sleep(min(1.0, max(0.05, self.seconds / 10)))

    def _held_as(self, etag: str | None) -> None:
        self.etag, self.lost = etag, None
        _LIVE[self.token] = self

    def _refusal(self, current: dict) -> str | None:
        """None when ``current`` may be taken over now, else why not (one line)."""
        if not current or current.get("token") == self.token:
            return None
        elastic = os.environ.get("TORCHELASTIC_RUN_ID", "")
        if elastic and current.get("elastic_run_id") == elastic \
                and int(current.get("restart_count", 0) or 0) < _restart_count():
            return None  # a previous attempt of this elastic job: torchelastic stopped its workers
        if current.get("owner") == self.owner and current.get("pid") == os.getpid() and on_this_host(current):
            return None  # another manager of this training in this very process: it is fenced from now on
        if not holder_alive(current):  # (after the check above: it may run a full garbage collection)
            return None
        until = _dt.datetime.fromtimestamp(float(current.get("expires_at", 0)), _dt.timezone.utc)
        return (f"store {self.store.uri} is being written by {current.get('owner')!r} (host "
                f"{current.get('host')}, pid {current.get('pid')}) until {until.isoformat(timespec='seconds')}; "
                f"refusing a second writer (a training started twice, or an orphan still running?). Stop it "
                f"or wait for its lease to expire")

    def renew(self) -> None:
        """Extend the lease, conditional on the ETag this holder last wrote.

        Raises:
            LeaseLost: another writer took it over (this one must stop writing).
        """
        with self._lock:
            if self.lost is not None:
                raise self.lost
            if self.etag is None:
                raise LeaseLost(f"the write lease on {self.store.uri} is not held by this writer")
            try:
                self.etag = write_conditional(self.store, LEASE, self._body(), if_match=self.etag)
            except (PreconditionFailed, FileNotFoundError):
                current = read_json(self.store, LEASE)
                if current and current.get("token") == self.token:  # our own retried request landed twice
                    self.etag = self.store.etag(LEASE)
                    return
                self.lost = LeaseLost(
                    f"lost the write lease on {self.store.uri}: {(current or {}).get('owner')!r} took it over "
                    f"(was this run stalled for longer than lease_seconds={self.seconds:g}?); nothing more "
                    f"is committed or deleted by this writer")
                _LIVE.pop(self.token, None)
                raise self.lost from None

    def fence(self) -> None:
        """Renew right before a commit or a deletion: raises :class:`LeaseLost` if taken over."""
        self.renew()

    def release(self) -> None:
        """Delete the lease if this writer still holds it (renewed first, so that no takeover can
        race the deletion); any failure is ignored (an expired lease is as good as a released one)."""
        with self._lock:
            if self.etag is None:
                return
            try:
                if self.lost is None:
                    self.renew()
                    self.store.delete(LEASE)
            except (RelaunchError, OSError):
                pass
            self.etag = None
            _LIVE.pop(self.token, None)
