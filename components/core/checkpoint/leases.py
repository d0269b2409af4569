"""The leases of one manager (rank 0): the store's write lease taken before training, its heartbeat
(which also renews the read leases), the read leases a reader holds on what it locates and loads
(:mod:`readers`), their release, and the claim retention makes before it deletes a step. Who may
take a lease over: :mod:`write_lease`.

    leases = Leases(store, owner="run-1", seconds=300)
    leases.take()                      # the write lease; a second writer is refused here
    info = leases.read_lease(store, 7, check, wait=True)
    leases.close()
"""

from __future__ import annotations

import sys
import threading
import weakref
from typing import Callable, TypeVar

from .layout import LEASE, PREFIX, read_json
from .write_lease import Lease, LeaseLost
from .readers import ReadLeases, claim_for_deletion
from ..contract.errors import RelaunchError
from ..store import Store

T = TypeVar("T")


class Leases:
    """The write lease of ``store`` held as ``owner``, its heartbeat, and the read leases this
    process holds in any store it reads.

    Args:
        store: the store written (its write lease).
        owner: the logical writer (:func:`~relaunch.components.core.checkpoint.write_lease.default_owner`).
        seconds: how long the write lease and the read leases last without a renewal; the heartbeat
            renews them every third of it once a lease is held.
        wait_seconds: how long taking the write lease waits for a live holder of the same owner.
    """

    def __init__(self, store: Store, owner: str, seconds: float, *, wait_seconds: float | None = None):
        self.store, self.owner, self.seconds = store, owner, float(seconds)
        self.lease = Lease(store, owner, seconds, wait_seconds=wait_seconds)
        self._reads: dict[str, ReadLeases] = {}  # store URI -> the read leases held there
        self._heartbeat: threading.Thread | None = None
        self._stop_beat = threading.Event()

    def take(self) -> None:
        """Take the write lease, start the heartbeat and abort the multipart uploads a killed writer
        left (nobody else writes here now).

        Raises:
            BadInput: another writer holds the lease.
        """
        self.lease.take()
        self._start_heartbeat()
        self.store.abort_incomplete_uploads(PREFIX + "/")

    def fence(self) -> None:
        """Renew the write lease now; raises LeaseLost when another writer took it over."""
        self.lease.fence()

    def holds(self) -> bool:
        """Whether this writer still holds the write lease: renewed, or, where the store cannot take
        the renewal (full), still the lease record of this writer."""
        try:
            self.lease.fence()
            return True
        except LeaseLost:
            return False
        except (OSError, RelaunchError):
            record = read_json(self.store, LEASE) or {}
            return self.lease.held and record.get("token") == self.lease.token

    def claim(self, step: int) -> bool:
        """Claim ``step`` for deletion (retention, right before it deletes): False keeps it."""
        return claim_for_deletion(self.store, step, token=self.lease.token, seconds=self.seconds,
                                  fence=self.lease.fence)

    def read_lease(self, store: Store, step: int, check: Callable[[], T], *, wait: bool) -> T | None:
        """``check()`` under a read lease on ``step`` of ``store`` (:meth:`ReadLeases.acquire`)."""
        return self.reads_in(store).acquire(step, check, wait=wait)

    def reads_in(self, store: Store) -> ReadLeases:
        """The read leases held in ``store`` (renewed by the heartbeat from now on)."""
        reads = self._reads.get(store.uri)
        if reads is None:
            reads = self._reads[store.uri] = ReadLeases(store, self.owner, self.seconds)
        self._start_heartbeat()
        return reads

    def release_reads(self) -> None:
        """Drop every read lease held (what this writer loaded is in its state now)."""
        for reads in self._reads.values():
            reads.release_all()

    def close(self, *, release: bool = True) -> None:
        """Stop the heartbeat; with ``release`` (rank 0) drop the read leases and the write lease."""
        self._stop_beat.set()
        if release:
            self.release_reads()
            self.lease.release()

    def _start_heartbeat(self) -> None:
        """Renew the write lease and the read leases every third of ``seconds`` until close. The
        thread holds this object weakly: leases dropped unclosed stop being renewed."""
        if self._heartbeat is not None:
            return
        ref, stop, interval = weakref.ref(self), self._stop_beat, max(0.05, self.seconds / 3)

        def beat() -> None:
            while not stop.wait(interval):
                leases = ref()
                if leases is None:
                    return
                try:
                    leases._beat()
                except LeaseLost as err:
                    print(f"relaunch: {err}", file=sys.stderr, flush=True)
                except Exception:  # noqa: BLE001 - a store hiccup: the next beat retries, the fence decides
                    pass
                del leases

        self._heartbeat = threading.Thread(target=beat, name="ckpt-lease-heartbeat", daemon=True)
        self._heartbeat.start()

    def _beat(self) -> None:
        for reads in list(self._reads.values()):
            reads.renew()
        if self.lease.etag is not None and self.lease.lost is None:
            self.lease.renew()

