"""Loading: a checkpoint of format 1, 2 or 3 read into a training state (every rank reads only
what its load plan names, checked against the manifest's digests), after the model fingerprint and
byte-order checks; a checkpoint found damaged while it is read is quarantined and the previous
committed one loaded.

    loader = Loader(Locator(store, leases), Ranks())
    info = loader.load(state, store)   # the newest intact committed checkpoint, or None
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from .fingerprint import model_fingerprint
from .layout import METADATA, CheckpointInfo, parse_checkpoint_uri
from .locator import Locator
from .ranks import Ranks
from .verify import ChunkDigests
from ..contract.classify import dcp_original
from ..contract.errors import BadInput, CorruptCheckpoint, RelaunchError
from ..store import FileStore, Store, open_store

IO_THREADS = max(1, min(4, os.cpu_count() or 1))
READ_THREADS = 8  # ranged reads (GETs) in flight per rank on S3; on a filesystem IO_THREADS, each one
# file front to back (more concurrent streams made cold reads slower on the 2-core machine's disk)


def source_of(uri: str, own: Store) -> tuple[Store, int]:
    """The store and step a checkpoint ``uri`` names: ``own`` when it is that store's, else opened."""
    root, step = parse_checkpoint_uri(uri)
    return (own if root.rstrip("/") == own.uri.rstrip("/") else open_store(root)), step


class Loader:
    """Reads checkpoints into training states on every rank.

    Args:
        locator: finds and checks what to load (and records damage found while reading).
        ranks: the ranks that load together (rank 0 locates, every rank reads its part).
        model_fingerprint: this model's; a checkpoint of another model is refused. Computed from
            ``state.model`` at each load when None.
        cache_dir: local directory for downloads of format-1 checkpoints from object stores
            (default: a temp dir, made on first use and removed by :meth:`close`).
    """

    def __init__(self, locator: Locator, ranks: Ranks, *, model_fingerprint: str | None = None,
                 cache_dir: str | os.PathLike | None = None):
        self.locator, self.ranks, self.model_fingerprint = locator, ranks, model_fingerprint
        self._cache_dir = Path(cache_dir) if cache_dir is not None else None
        self._own_cache: Path | None = None

    def load(self, state: Any, store: Store, step: int | None = None) -> CheckpointInfo | None:
        """Restore ``state`` in place from checkpoint ``step`` of ``store`` (None: the latest; a
        checkpoint found damaged while read is quarantined and the previous committed one loaded);
        None when there is none (collective).

        Raises:
            CorruptCheckpoint: the asked-for checkpoint does not verify, or holds unsafe objects.
            BadInput: the checkpoint belongs to another model, is of a newer format, or is not in the store.
        """
        damaged: set[int] = set()
        while True:
            found = self.ranks.agree(self.ranks.rank0(lambda: self.locator.find_for_load(store, step, damaged)))
            if found is None:
                return None
            info, manifest, metadata = found
            self._check_fingerprint(info, manifest, state)
            try:
                if isinstance(metadata, CorruptCheckpoint):
                    raise metadata
                from .dcp_io import collector_paused

                with collector_paused():  # ~10 objects a tensor live until the load ends: see there
                    self._read(state, info, manifest, store, metadata)
            except CorruptCheckpoint as err:
                self.locator.found_damaged(store, info.step, info.manifest_sha256, str(err))
                if step is not None:
                    raise
                print(f"relaunch: checkpoint {info.uri} is damaged ({err}); loading the previous committed "
                      f"checkpoint instead", file=sys.stderr, flush=True)
                damaged.add(info.step)
                continue
            return info

    def close(self) -> None:
        """Remove the download cache this loader made (idempotent)."""
        if self._own_cache is not None:
            shutil.rmtree(self._own_cache, ignore_errors=True)
            self._own_cache = None

    def _check_fingerprint(self, info: CheckpointInfo, manifest: dict[str, Any], state: Any) -> None:
        mine = self.model_fingerprint
        if mine is None and hasattr(state, "model"):
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
        from .safe_pickle import load_metadata

        if manifest["format_version"] == 1:
            from . import legacy_v1

            cache = None if type(store) is FileStore else self._cache()  # a local store is read in place
            local = self.ranks.agree(self.ranks.catch(lambda: str(legacy_v1.materialize(
                store, info.step, manifest, cache))), share=False)
            metadata = legacy_v1.read_metadata(local)
            reader = legacy_v1.safe_reader(local)
        else:
            from .dcp_io import StoreReader, payload_offsets

            digests = ChunkDigests(info.uri, manifest["files"])
            metadata = load_metadata(metadata_bytes, source=f"{info.uri}/{METADATA}")
            payloads = payload_offsets(manifest["files"]) if manifest["format_version"] >= 3 else None
            reader = StoreReader(store, info.key, metadata, digests, payloads=payloads, node_group=self.ranks.node_group,
                                 node_ranks=self.ranks.node_ranks,
                                 threads=IO_THREADS if hasattr(store, "path") else READ_THREADS)
        self._dcp_load(state, metadata, reader, info)

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

        from .dcp_io import safe_load_planner

        template = state.state_dict() if wrapped else dict(state)
        for per_rank in ("rng", "data"):  # another world size (or an older checkpoint): a rank's entry may be absent
            if isinstance(template.get(per_rank), dict):
                for name in list(template[per_rank]):
                    if not any(k.startswith(f"{per_rank}.{name}.") for k in stored):
                        del template[per_rank][name]
                if not template[per_rank]:
                    del template[per_rank]
        try:
            dcp.load(template, storage_reader=reader, planner=safe_load_planner(), process_group=self.ranks.group)
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
