"""One pipeline at a time per training: the lock ``relaunch run`` holds on the training it runs
(``runs/pipeline-lock.json``, spelled in :mod:`relaunch.components.core.store.records`).

The checkpoint write lease (:mod:`relaunch.components.core.checkpoint.write_lease`) keeps two *trainers* from
interleaving checkpoints, but it is taken by the workers, long after a pipeline opened its MLflow run;
two ``relaunch run --resume`` started a moment apart would both open, evaluate and register. This lock
is taken first, before anything of the pipeline is written: a create-if-absent record (the store's
conditional write) naming the process that holds it, released when that process ends its pipeline.

A holder is alive, on this host (same pid namespace), while its pid runs with the start time the
record names (a reused pid is another process); on another host, while its heartbeat (renewed every
:data:`HEARTBEAT_SECONDS`) is younger than :data:`STALE_SECONDS`. A lock whose holder is not alive is
taken over by a conditional overwrite: a ``relaunch run`` killed by SIGKILL leaves no lasting lock.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import socket
import sys
import threading
import time
import uuid

from ..contract.errors import BadInput, RelaunchError
from . import PreconditionFailed, Store
from .records import PIPELINE_LOCK_KEY, read_json
from .holder import on_this_host, pid_namespace, process_running, process_start

HEARTBEAT_SECONDS = 10.0
STALE_SECONDS = 60.0  # six missed heartbeats: a holder on another host is taken for gone


class TrainingInUse(BadInput):
    """Another live process runs a pipeline of this training (exit 2)."""


def holder_alive(record: dict | None) -> bool:
    """Whether the process that wrote lock ``record`` may still run its pipeline."""
    if not record:
        return False
    if on_this_host(record):
        return process_running(record["pid"], record.get("process_start") or "")
    return float(record.get("heartbeat", 0) or 0) + STALE_SECONDS > time.time()


def describe_holder(record: dict) -> str:
    """``pid 123 on host h (relaunch run, since 2026-12-04T20:01:02+00:00)``."""
    since = _dt.datetime.fromtimestamp(float(record.get("started", 0) or 0), _dt.timezone.utc)
    return (f"pid {record.get('pid')} on host {record.get('host')} ({record.get('command') or 'relaunch run'}, "
            f"since {since.isoformat(timespec='seconds')})")


class PipelineLock:
    """The pipeline lock of the training in ``store`` (named ``training`` in messages).

    Use :meth:`take` (or the context manager) before writing anything of a pipeline, :meth:`release`
    after its end; a heartbeat thread keeps the record fresh meanwhile.
    """

    def __init__(self, store: Store, training: str, command: str = "relaunch run"):
        self.store, self.training, self.command = store, training, command
        self.token = uuid.uuid4().hex
        self.etag: str | None = None
        self.started = time.time()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def _body(self) -> bytes:
        pid = os.getpid()
        return json.dumps({"token": self.token, "pid": pid, "host": socket.gethostname(),
                           "pid_namespace": pid_namespace(), "process_start": process_start(pid),
                           "command": self.command, "started": self.started, "heartbeat": time.time()}).encode()

    def take(self) -> "PipelineLock":
        """Take the lock, or take over one whose holder is gone.

        Raises:
            TrainingInUse: a live process holds it (one line naming its pid and host).
        """
        while True:
            if self.store.write_if_absent(PIPELINE_LOCK_KEY, self._body()):
                self.etag = self.store.etag(PIPELINE_LOCK_KEY)
                break
            etag = self.store.etag(PIPELINE_LOCK_KEY)
            current = read_json(self.store, PIPELINE_LOCK_KEY)
            if etag is None or current is None:
                continue  # released in between: create it
            if holder_alive(current):
                raise TrainingInUse(
                    f"the training {self.training} is being run by {describe_holder(current)}; one pipeline "
                    f"of a training at a time: wait for it to end, or stop it (kill {current.get('pid')}), then "
                    f"`relaunch run --resume`")
            try:
                self.store.write_bytes(PIPELINE_LOCK_KEY, self._body(), if_match=etag)
            except (PreconditionFailed, FileNotFoundError):
                continue  # another process moved first: judge its record
            if (read_json(self.store, PIPELINE_LOCK_KEY) or {}).get("token") == self.token:
                self.etag = self.store.etag(PIPELINE_LOCK_KEY)
                break
        self._thread = threading.Thread(target=self._beat, name="relaunch-pipeline-lock", daemon=True)
        self._thread.start()
        return self

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_SECONDS):
            with self._lock:
                if self.etag is None:
                    return
                try:
                    self.etag = self.store.write_bytes(PIPELINE_LOCK_KEY, self._body(), if_match=self.etag) \
                        or self.store.etag(PIPELINE_LOCK_KEY)
                except PreconditionFailed:
                    print(f"relaunch: the pipeline lock of training {self.training} was taken over by another "
                          f"process; its checkpoint lease still keeps one writer", file=sys.stderr, flush=True)
                    self.etag = None
                    return
                except (RelaunchError, OSError):
                    pass  # a store away for a while: the next beat tries again; on this host the pid counts

    def release(self) -> None:
        """Delete the lock if this process still holds it; failures are ignored (a lock whose
        process ended is stale anyway)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=HEARTBEAT_SECONDS)
        with self._lock:
            if self.etag is None:
                return
            try:
                if (read_json(self.store, PIPELINE_LOCK_KEY) or {}).get("token") == self.token:
                    self.store.delete(PIPELINE_LOCK_KEY)
            except (RelaunchError, OSError):
                pass
            self.etag = None

    def __enter__(self) -> "PipelineLock":
        return self.take() if self.etag is None else self

    def __exit__(self, *exc) -> None:
        self.release()
