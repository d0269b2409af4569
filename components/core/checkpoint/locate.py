"""Locating, one job of :class:`~components.core.checkpoint.manager.CheckpointManager`: the latest
intact checkpoint (under a read lease), the list, the best by a metric, a deep verify, pins, and the
quarantine bookkeeping (damage found is recorded here and in the store, never chosen again).

:class:`Locating` is a part of the manager (one of its base classes), not used alone.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from components.core.checkpoint import quarantine
from components.core.checkpoint.layout import (INFLIGHT, LATEST, MANIFEST_DIGEST, METADATA, PINS, CheckpointInfo,
                                               at_once,
                                               checkpoint_steps, info_of, now, parse_manifest, parse_pin, pin_key,
                                               read_json, read_manifest_bytes, step_key)
from components.core.checkpoint.readers import deletion_in_progress
from components.core.checkpoint.verify import check_files, deep_verify
from components.core.contract.errors import BadInput, CorruptCheckpoint
from components.core.store import Store


class Locating:
    """Which checkpoints there are and which are intact; the public methods guard, then call these."""

    def _locate_leased(self, skip: set[int] | frozenset = frozenset()) -> CheckpointInfo | None:
        """:meth:`_locate`, then a read lease on the answer, checked again under it; a step being
        deleted meanwhile is passed over for the next one."""
        passed: set[int] = set()
        reads = self._reads_in(self.store)
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
            leased = self._read_lease(self.store, info.step, lambda: self._checked(info.step), wait=False)
            if leased is not None:
                return leased
            passed.add(info.step)
        return None

    def _locate(self, skip: set[int] | frozenset = frozenset(),
                pointers: tuple[dict[str, Any], dict[str, Any]] | None = None) -> CheckpointInfo | None:
        """latest.json and inflight.json first (3 reads and one listing; ``pointers``: the two as
        the caller just read them), the step directories newest first only when both fail."""
        tried: set[int] = set(skip)
        pointer, inflight = pointers or (read_json(self.store, LATEST), read_json(self.store, INFLIGHT))
        p = pointer.get("step") if pointer else None
        q = inflight.get("step") if inflight else None
        if isinstance(q, int) and q not in tried and (not isinstance(p, int) or q > p):
            tried.add(q)  # committed after the pointer was last advanced (a crash in between)?
            if (info := self._checked_quiet(q)) is not None:
                return info
        if isinstance(p, int) and p not in tried:
            tried.add(p)
            try:
                manifest = self._manifest(p)
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

    def _manifest(self, step: int, store: Store | None = None) -> dict[str, Any]:
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
            self._found_damaged(store, step, sha, str(error))
        if error is not None:
            raise error
        if len(rest) > 1:
            self._metadata_read = (store.uri, step, sha, rest[1])
        return manifest

    def _checked(self, step: int, store: Store | None = None) -> CheckpointInfo:
        store = store or self.store
        manifest = self._manifest(step, store)
        self._last_checked = (store.uri, step, manifest)
        return info_of(store, step, manifest)

    def _checked_quiet(self, step: int) -> CheckpointInfo | None:
        try:
            return self._checked(step)
        except (CorruptCheckpoint, FileNotFoundError):
            return None

    def _found_damaged(self, store: Store, step: int, manifest_sha256: str, reason: str) -> None:
        """Record checkpoint ``step`` as damaged: here, and in the store (rank 0, best effort)."""
        self._damaged[(store.uri, step)] = (manifest_sha256, reason)
        if self.rank == 0:
            quarantine.record(store, step, manifest_sha256, reason, found_by=self.owner)

    def _list(self) -> list[CheckpointInfo]:
        """The body of :meth:`CheckpointManager.list`."""
        out = []
        for step in checkpoint_steps(self.store):
            try:
                out.append(self._checked(step))
            except (CorruptCheckpoint, FileNotFoundError):
                continue
        return out

    def _quarantined(self) -> list[dict[str, Any]]:
        """The body of :meth:`CheckpointManager.quarantined`."""
        out = [{**r, "recorded": True} for r in quarantine.records(self.store)]
        in_place = {(r["step"], r.get("manifest_sha256")) for r in out if r["moved_to"] is None}
        for (uri, step), (sha, reason) in sorted(self._damaged.items()):
            if uri == self.store.uri and (step, sha) not in in_place:
                out.append({"step": step, "manifest_sha256": sha, "reason": reason, "moved_to": None,
                            "recorded": False})
        return sorted(out, key=lambda r: r["step"])

    def _verify(self, step: int, deep: bool) -> CheckpointInfo:
        """The body of :meth:`CheckpointManager.verify`."""
        # manifest digest, files and sizes (quarantined: raises), under a read lease
        manifest = self._read_lease(self.store, step, lambda: self._manifest(step), wait=True)
        if deep:
            try:
                deep_verify(self.store, step, manifest)
            except CorruptCheckpoint as err:
                self._found_damaged(self.store, step, manifest["_sha256"], str(err))
                raise
        return info_of(self.store, step, manifest)

    def _best(self, metric: str | None, mode: str | None) -> CheckpointInfo | None:
        """The body of :meth:`CheckpointManager.best`."""
        metric, mode = metric or self.best_metric, mode or self.mode
        if not metric:
            raise BadInput("best() needs a metric name (best_metric)")
        scored = [i for i in self.list() if metric in i.metrics]  # intact ones only
        scored.sort(key=lambda i: (i.metrics[metric] if mode == "min" else -i.metrics[metric], -i.step))
        for info in scored:
            if self._read_lease(self.store, info.step, lambda: self._checked(info.step), wait=False) is not None:
                return info
        return None

    def _pin(self, step: int, reason: str) -> None:
        """The body of :meth:`CheckpointManager.pin`."""
        # raises CorruptCheckpoint if not committed; the read lease holds it until the pin is written
        self._read_lease(self.store, step, lambda: self._manifest(step), wait=True)
        body = json.dumps({"step": step, "reason": reason, "created_at": now(), "owner": self.owner})
        self.store.write_bytes(pin_key(step, reason), body.encode())

    def _pins(self) -> dict[int, list[str]]:
        """The body of :meth:`CheckpointManager.pins`."""
        out: dict[int, list[str]] = {}
        for key in self.store.list(PINS + "/"):
            parsed = parse_pin(key)
            if parsed:
                out.setdefault(parsed[0], []).append(parsed[1])
        return out
