"""Which checkpoints there are and which are intact: the latest (under a read lease), the list, the
best by a metric, a deep verify, pins, and the quarantine bookkeeping (damage found is recorded
here and in the store, never chosen again).

    locator = Locator(store, Leases(store, owner="reader", seconds=300))
    info = locator.latest()            # the newest intact committed checkpoint, read-leased, or None
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from . import quarantine
from .layout import (INFLIGHT, LATEST, MANIFEST_DIGEST, METADATA, PINS, CheckpointInfo, pointed_steps,
                     at_once, checkpoint_steps, info_of, now, parse_manifest, parse_pin,
                     pin_key, read_json, read_manifest_bytes, step_key)
from .leases import Leases
from .readers import deletion_in_progress
from .verify import ChunkDigests, check_files, deep_verify
from ..contract.errors import BadInput, CorruptCheckpoint
from ..store import Store


class Locator:
    """Which checkpoints of ``store`` there are and which are intact, for one process.

    Args:
        store: the store of the training.
        leases: the read leases taken on what is located (and renewed by their heartbeat).
        rank: this process's rank; damage found is recorded in the store by rank 0 only.

    Damage this process found is remembered here, by store and manifest, even where the store refused
    the quarantine marker (read-only credentials).
    """

    def __init__(self, store: Store, leases: Leases, *, rank: int = 0):
        self.store, self.leases, self.rank = store, leases, rank
        # damage found by this process: (store URI, step) -> (manifest sha256, reason)
        self._damaged: dict[tuple[str, int], tuple[str, str]] = {}
        self._last_checked: tuple[str, int, dict[str, Any]] | None = None  # (store, step, manifest) checked last
        self._loading = False  # find_for_load is locating: the manifest check reads .metadata too
        self._metadata_read: tuple[str, int, str, Any] | None = None  # (store, step, manifest sha256, bytes or error)
        # committed manifests this writer wrote or retention read under its write lease: (store URI, step) ->
        # manifest. A committed manifest never changes; only the lease holder writes a step again, after
        # moving the old one aside (forget), and a lease once lost is never held again by this manager
        self._committed: dict[tuple[str, int], dict[str, Any]] = {}

    def latest(self, skip: set[int] | frozenset = frozenset()) -> CheckpointInfo | None:
        """The newest intact committed checkpoint not in ``skip``, under a read lease (checked again
        under it; a step being deleted meanwhile is passed over for the next one), or None."""
        passed: set[int] = set()
        reads = self.leases.reads_in(self.store)
        for attempt in range(10):
            # lease the steps latest.json and inflight.json name before _locate checks them: a writer
            # faster than this reader would otherwise delete each one before its check is done
            found = at_once(self.store, lambda: read_json(self.store, LATEST), lambda: read_json(self.store, INFLIGHT))
            for error in (f for f in found if isinstance(f, Exception)):
                raise error
            pointers = (found[0] or {}, found[1] or {})
            early = {p["step"] for p in pointers if isinstance(p.get("step"), int)} - set(skip) - passed
            for step in early:
                reads.hold(step)
            # the deletion markers of the leased steps, read before _locate checks their manifests: the
            # handshake's order (lease, marker, check), so that the one _locate picks needs no second check
            clear = {step for step in early if step in reads.held and not deletion_in_progress(self.store, step)}
            info = self._locate(skip=set(skip) | passed, pointers=pointers)
            for step in early:
                if (info is None or step != info.step) and step not in reads.confirmed:
                    reads.release(step)
            if info is None:
                # a writer that commits (and deletes) faster than this reader locates can leave it
                # nothing it checked in time: start over while latest.json names a step
                pointer = read_json(self.store, LATEST) or {}
                if attempt < 9 and (passed or isinstance(pointer.get("step"), int) and pointer["step"] not in skip):
                    passed.clear()
                    continue
                return None
            last = self._last_checked
            if info.step in clear and last is not None and last[:2] == (self.store.uri, info.step):
                reads.confirmed.add(info.step)
                return info
            leased = self.leases.read_lease(self.store, info.step, lambda: self.checked(info.step), wait=False)
            if leased is not None:
                return leased
            passed.add(info.step)
        return None

    def find_for_load(self, store: Store, step: int | None,
                      damaged: set[int]) -> tuple[CheckpointInfo, dict[str, Any], Any] | None:
        """The checkpoint a load reads (``step`` of ``store``, else the latest not in ``damaged``)
        under a read lease, its checked manifest and, for formats 2 and 3, its ``.metadata`` checked
        against its digest (or the CorruptCheckpoint that check raised); None when there is none.

        Raises:
            CorruptCheckpoint, BadInput: as :meth:`manifest`, for an asked-for ``step``.
        """
        self._last_checked = self._metadata_read = None
        self._loading = True
        try:
            if step is None:
                info = self.latest(skip=damaged)
            else:
                info = self.leases.read_lease(store, step, lambda: self.checked(step, store), wait=True)
            if info is None:
                return None
            manifest = self._manifest_checked(info, store)
        finally:
            self._loading = False
        metadata: bytes | CorruptCheckpoint | None = None
        if manifest["format_version"] >= 2:
            try:
                metadata = self._metadata_bytes(store, info, ChunkDigests(info.uri, manifest["files"]))
            except CorruptCheckpoint as err:
                metadata = err
        return info, manifest, metadata

    def _manifest_checked(self, info: CheckpointInfo, store: Store) -> dict[str, Any]:
        """The manifest of ``info``: the one its read lease's check just read (3 requests fewer: the
        manifest, its quarantine marker and the listing), else read and checked again."""
        last = self._last_checked
        if last is not None and last[:2] == (store.uri, info.step) and last[2].get("_sha256") == info.manifest_sha256:
            return last[2]
        return self.manifest(info.step, store)

    def _metadata_bytes(self, store: Store, info: CheckpointInfo, digests: ChunkDigests) -> bytes:
        """``.metadata``, read once per job (rank 0) and checked against its digest."""
        read, self._metadata_read = self._metadata_read, None
        try:
            if read is not None and read[:3] == (store.uri, info.step, info.manifest_sha256):
                if isinstance(read[3], Exception):
                    raise read[3]
                body = read[3]
            else:
                body = store.read_bytes(f"{info.key}/{METADATA}")
        except FileNotFoundError:
            raise CorruptCheckpoint(f"{info.uri}/{METADATA} is missing") from None
        digests.check(METADATA, 0, body)
        return body

    def _locate(self, skip: set[int] | frozenset = frozenset(),
                pointers: tuple[dict[str, Any], dict[str, Any]] | None = None) -> CheckpointInfo | None:
        """latest.json and inflight.json first (3 reads and one listing; ``pointers``: the two as
        the caller just read them), the step directories newest first only when both fail."""
        tried: set[int] = set(skip)
        pointer, inflight = pointers or (read_json(self.store, LATEST), read_json(self.store, INFLIGHT))
        q, p = pointed_steps(pointer, inflight)
        if q is not None and q not in tried:
            tried.add(q)  # committed after the pointer was last advanced (a crash in between)?
            if (info := self._checked_quiet(q)) is not None:
                return info
        if p is not None and p not in tried:
            tried.add(p)
            try:
                manifest = self.manifest(p)
            except (CorruptCheckpoint, FileNotFoundError):
                manifest = None
            # another manifest than the pointer's: edited (a legacy one, without its own digest), or
            # the step was written again after a damaged one and the crash came before the pointer
            if manifest is not None and (manifest["_sha256"] == pointer.get("manifest_sha256")
                                         or MANIFEST_DIGEST in manifest):
                self._last_checked = (self.store.uri, p, manifest)
                return info_of(self.store, p, manifest)
        for step in reversed(checkpoint_steps(self.store)):
            if step in tried:
                continue
            if (info := self._checked_quiet(step)) is not None:
                return info
        return None

    def manifest(self, step: int, store: Store | None = None) -> dict[str, Any]:
        """The manifest of committed checkpoint ``step`` after the O(1) check: not quarantined, the
        manifest parses and matches its own digest, every listed file exists with its size. What
        fails the check is damage: quarantined here, then raised.

        Raises:
            CorruptCheckpoint: not committed (no manifest: not damage, nothing recorded) or damaged.
            BadInput: a checkpoint of a newer format (not damage either).
        """
        store = store or self.store
        raw = read_manifest_bytes(store, step)
        sha = hashlib.sha256(raw).hexdigest()
        uri = store.uri_for(step_key(step))
        known = self._damaged.get((store.uri, step))
        if known is not None and known[0] == sha:
            raise CorruptCheckpoint(f"{uri} is damaged: {known[1]}")
        try:
            manifest, error = parse_manifest(store, step, raw), None
        except (CorruptCheckpoint, BadInput) as err:
            manifest, error = None, err
        # its quarantine marker, the listing of its files and, for a load, its .metadata: one round trip
        calls = [lambda: quarantine.find(store, step, sha)]
        if manifest is not None:
            calls.append(lambda: check_files(store, step, manifest))
            if self._loading and manifest["format_version"] >= 2:
                calls.append(lambda: store.read_bytes(f"{step_key(step)}/{METADATA}"))
        record, *rest = at_once(store, *calls)
        if isinstance(record, Exception):
            raise record
        if record is not None:
            raise CorruptCheckpoint(f"{uri} is quarantined as damaged since {record.get('found_at', '?')} "
                                    f"({record.get('reason', '?')})")
        error = error or (rest[0] if rest and isinstance(rest[0], Exception) else None)
        if isinstance(error, CorruptCheckpoint):
            self.found_damaged(store, step, sha, str(error))
        if error is not None:
            raise error
        if len(rest) > 1:
            self._metadata_read = (store.uri, step, sha, rest[1])
        return manifest

    def remember(self, step: int, body: bytes) -> None:
        """Remember the manifest this writer just committed for ``step`` (its bytes, no request)."""
        self._committed[(self.store.uri, step)] = parse_manifest(self.store, step, body)

    def retained(self, step: int, keys: set[str], markers: set[str]) -> dict[str, Any]:
        """:meth:`manifest` for retention, which holds the write lease and has just listed the store:
        ``keys``, the keys of the step's directory, ``markers``, the quarantine markers. A manifest
        remembered (committed or read here before) is not read again while every file it names is
        listed and no marker covers it; otherwise it is read and checked as :meth:`manifest` does.

        Raises:
            CorruptCheckpoint, BadInput: as :meth:`manifest`.
        """
        known = self._committed.get((self.store.uri, step))
        if known is not None:
            key = step_key(step)
            if quarantine.marker_key(step, known["_sha256"]) in markers:  # a reader found it damaged
                raise CorruptCheckpoint(f"{self.store.uri_for(key)} is quarantined as damaged")
            if all(f"{key}/{name}" in keys for name in known["files"]):
                return known
            self._committed.pop((self.store.uri, step), None)  # a file is gone: checked again, as damage
        manifest = self.manifest(step)
        self._committed[(self.store.uri, step)] = manifest
        return manifest

    def checked(self, step: int, store: Store | None = None) -> CheckpointInfo:
        """The info of committed checkpoint ``step`` after :meth:`manifest`'s check."""
        store = store or self.store
        manifest = self.manifest(step, store)
        self._last_checked = (store.uri, step, manifest)
        return info_of(store, step, manifest)

    def forget(self, step: int) -> None:
        """Forget the damage found in ``step`` (moved aside: the step may be written again)."""
        self._damaged.pop((self.store.uri, step), None)
        self._committed.pop((self.store.uri, step), None)

    def _checked_quiet(self, step: int) -> CheckpointInfo | None:
        try:
            return self.checked(step)
        except (CorruptCheckpoint, FileNotFoundError):
            return None

    def found_damaged(self, store: Store, step: int, manifest_sha256: str, reason: str) -> None:
        """Record checkpoint ``step`` as damaged: here, and in the store (rank 0, best effort)."""
        self._damaged[(store.uri, step)] = (manifest_sha256, reason)
        self._committed.pop((store.uri, step), None)
        if self.rank == 0:
            quarantine.record(store, step, manifest_sha256, reason, found_by=self.leases.owner)

    def list(self) -> list[CheckpointInfo]:
        """Every intact committed checkpoint, oldest first (damaged ones quarantined and left out)."""
        out = []
        for step in checkpoint_steps(self.store):
            try:
                out.append(self.checked(step))
            except (CorruptCheckpoint, FileNotFoundError):
                continue
        return out

    def quarantined(self) -> list[dict[str, Any]]:
        """The quarantine records of the store, plus damage found here that the store did not record."""
        out = [{**r, "recorded": True} for r in quarantine.records(self.store)]
        in_place = {(r["step"], r.get("manifest_sha256")) for r in out if r["moved_to"] is None}
        for (uri, step), (sha, reason) in sorted(self._damaged.items()):
            if uri == self.store.uri and (step, sha) not in in_place:
                out.append({"step": step, "manifest_sha256": sha, "reason": reason, "moved_to": None,
                            "recorded": False})
        return sorted(out, key=lambda r: r["step"])

    def verify(self, step: int, deep: bool = True) -> CheckpointInfo:
        """Checkpoint ``step`` checked against its manifest (:meth:`CheckpointManager.verify`)."""
        # manifest digest, files and sizes (quarantined: raises), under a read lease
        manifest = self.leases.read_lease(self.store, step, lambda: self.manifest(step), wait=True)
        if deep:
            try:
                deep_verify(self.store, step, manifest)
            except CorruptCheckpoint as err:
                self.found_damaged(self.store, step, manifest["_sha256"], str(err))
                raise
        return info_of(self.store, step, manifest)

    def best(self, metric: str | None, mode: str = "min") -> CheckpointInfo | None:
        """The intact committed checkpoint with the best ``metric``, read-leased (ties: the newer step)."""
        if not metric:
            raise BadInput("best() needs a metric name (best_metric)")
        scored = [i for i in self.list() if metric in i.metrics]  # intact ones only
        scored.sort(key=lambda i: (i.metrics[metric] if mode == "min" else -i.metrics[metric], -i.step))
        for info in scored:
            if self.leases.read_lease(self.store, info.step, lambda: self.checked(info.step), wait=False) is not None:
                return info
        return None

    def pin(self, step: int, reason: str) -> None:
        """Protect committed ``step`` from retention (:meth:`CheckpointManager.pin`)."""
        # raises CorruptCheckpoint if not committed; the read lease holds it until the pin is written
        self.leases.read_lease(self.store, step, lambda: self.manifest(step), wait=True)
        body = json.dumps({"step": step, "reason": reason, "created_at": now(), "owner": self.leases.owner})
        self.store.write_bytes(pin_key(step, reason), body.encode())

    def pins(self) -> dict[int, list[str]]:
        """Pinned steps and their reasons."""
        out: dict[int, list[str]] = {}
        for key in self.store.list(PINS + "/"):
            parsed = parse_pin(key)
            if parsed:
                out.setdefault(parsed[0], []).append(parsed[1])
        return out
