"""Loading, one job of :class:`~components.core.checkpoint.manager.CheckpointManager`: a checkpoint
of format 1, 2 or 3 read into a training state (every rank reads only what its load plan names,
checked against the manifest's digests), after the model fingerprint and byte-order checks; a
checkpoint found damaged while it is read is quarantined and the previous committed one loaded.

:class:`Loading` is a part of the manager (one of its base classes), not used alone.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from components.core.checkpoint.layout import METADATA, CheckpointInfo, parse_checkpoint_uri
from components.core.checkpoint.verify import ChunkDigests
from components.core.contract.classify import dcp_original
from components.core.contract.errors import BadInput, CorruptCheckpoint, RelaunchError
from components.core.store import FileStore, Store, open_store

IO_THREADS = max(1, min(4, os.cpu_count() or 1))
READ_THREADS = 8  # ranged reads (GETs) in flight per rank on S3; on a filesystem IO_THREADS, each one
# file front to back (more concurrent streams made cold reads slower on the 2-core machine's disk)


class Loading:
    """Load: :meth:`CheckpointManager.load` guards, then calls :meth:`_load`."""

    def _load(self, state: Any, step: int | None, uri: str | None) -> CheckpointInfo | None:
        """The body of :meth:`CheckpointManager.load` (guarded by it): locate, check, read; on damage
        fall back to the previous committed checkpoint (with neither ``step`` nor ``uri``)."""
        store = self.store
        if uri is not None:
            root, step = parse_checkpoint_uri(uri)
            if root.rstrip("/") != self.store.uri.rstrip("/"):
                store = open_store(root)
        damaged: set[int] = set()
        while True:
            found = self._agree(self._rank0(lambda: self._find(store, step, damaged)))
            if found is None:
                return None
            info, manifest, metadata = found
            self._check_fingerprint(info, manifest, state)
            try:
                if isinstance(metadata, CorruptCheckpoint):
                    raise metadata
                self._read(state, info, manifest, store, metadata)
            except CorruptCheckpoint as err:
                self._found_damaged(store, info.step, info.manifest_sha256, str(err))
                if step is not None:
                    raise
                print(f"relaunch: checkpoint {info.uri} is damaged ({err}); loading the previous committed "
                      f"checkpoint instead", file=sys.stderr, flush=True)
                damaged.add(info.step)
                continue
            if store is self.store:
                self._latest_known = False
            return info

    def _find(self, store: Store, step: int | None, damaged: set[int]) -> tuple[Any, ...] | None:
        """Rank 0: the checkpoint to load (``step``, else the latest not in ``damaged``) under a read
        lease, its checked manifest and, for formats 2 and 3, its ``.metadata`` checked against its
        digest (or the CorruptCheckpoint that check raised); None when there is none. One agreement
        hands all three to every rank (a gloo collective each cost 5-15 ms on a busy 2-core machine)."""
        self._last_checked = self._metadata_read = None
        self._loading = True  # the manifest checks read .metadata in their round trip (Locating._manifest)
        try:
            if step is None:
                info = self._locate_leased(skip=damaged)
            else:
                info = self._read_lease(store, step, lambda: self._checked(step, store), wait=True)
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
        return self._manifest(info.step, store)

    def _check_fingerprint(self, info: CheckpointInfo, manifest: dict[str, Any], state: Any) -> None:
        mine = self.model_fingerprint
        if mine is None and hasattr(state, "model"):
            from components.core.trainer.state import model_fingerprint

            mine = model_fingerprint(state.model)
        theirs = manifest.get("model_fingerprint")
        if mine and theirs and mine != theirs:
            raise BadInput(f"checkpoint of another model: {info.uri} was written for model {theirs}, "
                           f"this model is {mine} (wrong store URI or model config?)")
        if manifest.get("byteorder", "little") != sys.byteorder:
            raise BadInput(f"{info.uri} was written on a {manifest.get('byteorder')}-endian machine; "
                           f"this one is {sys.byteorder}-endian")

    def _cache(self) -> Path:
        if self._cache_dir is not None:
            return self._cache_dir
        if self._own_cache is None:
            self._own_cache = Path(tempfile.mkdtemp(prefix="relaunch-ckpt-"))
        return self._own_cache

    def _read(self, state: Any, info: CheckpointInfo, manifest: dict[str, Any], store: Store,
              metadata_bytes: bytes | None) -> None:
        """Load the checkpoint into ``state`` with DCP (every rank); ``metadata_bytes``: its checked
        ``.metadata`` (formats 2 and 3)."""
        from components.core.checkpoint.safe_pickle import load_metadata

        if manifest["format_version"] == 1:
            from components.core.checkpoint import legacy_v1

            cache = None if type(store) is FileStore else self._cache()  # a local store is read in place
            local = self._agree(self._catch(lambda: str(legacy_v1.materialize(
                store, info.step, manifest, cache))), share=False)
            metadata = legacy_v1.read_metadata(local)
            reader = legacy_v1.safe_reader(local)
        else:
            from components.core.checkpoint.dcp_io import StoreReader, payload_offsets

            digests = ChunkDigests(info.uri, manifest["files"])
            metadata = load_metadata(metadata_bytes, source=f"{info.uri}/{METADATA}")
            payloads = payload_offsets(manifest["files"]) if manifest["format_version"] >= 3 else None
            reader = StoreReader(store, info.key, metadata, digests, payloads=payloads, node_group=self._node_group,
                                 node_ranks=self._node_ranks,
                                 threads=IO_THREADS if hasattr(store, "path") else READ_THREADS)
        self._dcp_load(state, metadata, reader, info)

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

    def _dcp_load(self, state: Any, metadata: Any, reader: Any, info: CheckpointInfo) -> None:
        stored = set(metadata.state_dict_metadata)
        wrapped = hasattr(state, "state_dict") and hasattr(state, "load_state_dict") and not isinstance(state, dict)
        undo = state.prepare_load(metadata.state_dict_metadata) if wrapped and hasattr(state, "prepare_load") else None
        try:
            self._dcp_load_into(state, wrapped, stored, reader, info)
        except BaseException:
            if undo is not None:
                undo()
            raise

    def _dcp_load_into(self, state: Any, wrapped: bool, stored: set[str], reader: Any, info: CheckpointInfo) -> None:
        import torch
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.stateful import Stateful

        from components.core.checkpoint.dcp_io import safe_load_planner

        template = state.state_dict() if wrapped else dict(state)
        if isinstance(template.get("rng"), dict):  # another world size: a rank's stream may be absent
            for name in list(template["rng"]):
                if not any(k.startswith(f"rng.{name}.") for k in stored):
                    del template["rng"][name]
            if not template["rng"]:
                del template["rng"]
        try:
            dcp.load(template, storage_reader=reader, planner=safe_load_planner(), process_group=self._group)
        except RelaunchError:
            raise
        except (Exception, CheckpointException) as err:  # DCP wraps per-rank errors (a BaseException)
            original = dcp_original(err)  # a damaged checkpoint first: every rank then falls back together
            if isinstance(original, BadInput) and not isinstance(original, CorruptCheckpoint):
                raise BadInput(f"checkpoint of another model: {info.uri} does not fit this state ({original})") from None
            if isinstance(original, RelaunchError):
                raise original from None
            raise
        if wrapped:
            state.load_state_dict(template)
        else:
            for k, v in template.items():
                if isinstance(state.get(k), Stateful) and not isinstance(state[k], torch.Tensor):
                    pass  # DCP called load_state_dict on it already
                else:
                    state[k] = v
