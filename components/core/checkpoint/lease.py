"""The single-writer lease of a store (``checkpoints/LEASE.json``): a pipeline started twice never
interleaves two histories. Taken by conditional create, renewed by If-Match on the ETag last written,
taken over only by the same owner (a restart of the same run) or after ``expires_at``."""

from __future__ import annotations

import datetime as _dt
import json
import os
import socket
import time
import uuid

from components.core.checkpoint.layout import LEASE, now, read_json, write_conditional
from components.core.contract.errors import BadInput, RelaunchError
from components.core.store import PreconditionFailed, Store


def default_owner() -> str:
    """$RELAUNCH_OWNER, the pipeline run id or $TORCHELASTIC_RUN_ID, else host:pid."""
    for name in ("RELAUNCH_OWNER", "RELAUNCH_PIPELINE_RUN_ID", "TORCHELASTIC_RUN_ID"):
        if os.environ.get(name):
            return os.environ[name]
    return f"{socket.gethostname()}:{os.getpid()}"


class Lease:
    """The write lease of ``store`` held (or not yet) by ``owner``."""

    def __init__(self, store: Store, owner: str, seconds: float):
        self.store, self.owner, self.seconds = store, owner, float(seconds)
        self.token = uuid.uuid4().hex
        self.etag: str | None = None

    @property
    def held(self) -> bool:
        return self.etag is not None

    def take(self) -> None:
        """Take the lease, or renew it when held.

        Raises:
            BadInput: another owner holds an unexpired lease, or took ours over.
        """
        current_time = time.time()
        body = json.dumps({"owner": self.owner, "token": self.token, "host": socket.gethostname(),
                           "pid": os.getpid(), "acquired_at": now(),
                           "expires_at": current_time + self.seconds}).encode()
        if self.etag is not None:
            try:
                self.etag = write_conditional(self.store, LEASE, body, if_match=self.etag)
            except PreconditionFailed:
                current = read_json(self.store, LEASE)
                if not current or current.get("token") != self.token:
                    raise BadInput(f"lost the write lease on {self.store.uri}: "
                                   f"{(current or {}).get('owner')!r} took it over (was this run stalled "
                                   f"for longer than lease_seconds={self.seconds:g}?)") from None
                self.etag = self.store.etag(LEASE)
            return
        if self.store.write_if_absent(LEASE, body):
            self.etag = self.store.etag(LEASE)
            return
        etag = self.store.etag(LEASE)
        current = read_json(self.store, LEASE) or {}
        mine = current.get("token") == self.token or current.get("owner") == self.owner
        expired = float(current.get("expires_at", 0) or 0) < current_time
        if not (mine or expired):
            until = _dt.datetime.fromtimestamp(float(current.get("expires_at", 0)), _dt.timezone.utc)
            raise BadInput(
                f"store {self.store.uri} is being written by {current.get('owner')!r} "
                f"(host {current.get('host')}, pid {current.get('pid')}) until "
                f"{until.isoformat(timespec='seconds')}; refusing a second writer (a pipeline started "
                f"twice?). Wait for it to finish or for the lease to expire")
        try:
            self.etag = write_conditional(self.store, LEASE, body, if_match=etag)
        except PreconditionFailed:
            raise BadInput(f"another writer took the lease on {self.store.uri} at the same time") from None

    def release(self) -> None:
        """Delete the lease if held; a failure is ignored (an expired lease is as good as a released one)."""
        if self.etag is None:
            return
        try:
            self.store.delete(LEASE)
        except (RelaunchError, OSError):
            pass
        self.etag = None
