"""Leases, one job of :class:`~components.core.checkpoint.manager.CheckpointManager` (rank 0): the
store's write lease taken before training, its heartbeat (which also renews the read leases), the
read leases a reader holds on what it locates and loads (:mod:`readers`), their release, and the
claim retention makes before it deletes a step. Who may take a lease over: :mod:`lease`.

:class:`Leasing` is a part of the manager (one of its base classes), not used alone.
"""

from __future__ import annotations

import sys
import threading
import weakref

from components.core.checkpoint.layout import LATEST, PREFIX
from components.core.checkpoint.lease import LeaseLost
from components.core.checkpoint.readers import ReadLeases, claim_for_deletion
from components.core.store import Store


class Leasing:
    """The write lease, its heartbeat and the read leases of one manager."""

    def _take_lease(self) -> None:
        self.lease.take()
        self._latest_etag = self.store.etag(LATEST)
        self._latest_known = True
        self._start_heartbeat()
        self.store.abort_incomplete_uploads(PREFIX + "/")  # a killed writer's: nobody else writes here now

    def _start_heartbeat(self) -> None:
        """Renew the write lease and the read leases every third of ``lease_seconds`` until close.
        The thread holds the manager weakly: a manager dropped unclosed stops renewing."""
        if self._heartbeat is not None:
            return
        ref, stop, interval = weakref.ref(self), self._stop_beat, max(0.05, self.lease_seconds / 3)

        def beat() -> None:
            while not stop.wait(interval):
                mgr = ref()
                if mgr is None:
                    return
                try:
                    mgr._beat()
                except LeaseLost as err:
                    print(f"relaunch: {err}", file=sys.stderr, flush=True)
                except Exception:  # noqa: BLE001 - a store hiccup: the next beat retries, the fence decides
                    pass
                del mgr

        self._heartbeat = threading.Thread(target=beat, name="ckpt-lease-heartbeat", daemon=True)
        self._heartbeat.start()

    def _beat(self) -> None:
        for reads in list(self._reads.values()):
            reads.renew()
        if self.lease.etag is not None and self.lease.lost is None:
            self.lease.renew()

    def _read_lease(self, store: Store, step: int, check, *, wait: bool):
        """``check()`` under a read lease on ``step`` (:meth:`ReadLeases.acquire`)."""
        return self._reads_in(store).acquire(step, check, wait=wait)

    def _reads_in(self, store: Store) -> ReadLeases:
        reads = self._reads.get(store.uri)
        if reads is None:
            reads = self._reads[store.uri] = ReadLeases(store, self.owner, self.lease_seconds)
        self._start_heartbeat()
        return reads

    def _release_reads(self) -> None:
        for reads in self._reads.values():
            reads.release_all()

    def _claim(self, step: int) -> bool:
        return claim_for_deletion(self.store, step, token=self.lease.token, seconds=self.lease_seconds,
                                  fence=self.lease.fence)

    def _stop_leases(self) -> None:
        """At close: stop the heartbeat; rank 0 releases the read leases and the write lease."""
        self._stop_beat.set()
        if self.rank == 0:
            self._release_reads()
            self.lease.release()
