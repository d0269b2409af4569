"""DCP straight against relaunch's Store (format 2): no staging copy, integrity in the same pass.

:class:`StoreWriter` streams each rank's items into ``__<rank>_<n>.distcp`` through
``Store.open_writer`` (a file written in place, or a streaming S3 multipart upload) as raw bytes:
a tensor's bytes in its dtype's native (little-endian) order, a bytes item as DCP serialised it.
Each item is cut into chunks of at most ``CHUNK_BYTES`` whose XXH3-128 digests are taken while
writing and returned in ``files`` for the manifest.

:class:`StoreReader` reads exactly the items its rank's load plan names, each chunk by one ranged
read (``Store.read_into``) in parallel, straight into the destination tensor when it has the stored
shape, dtype and layout on CPU, and checks every chunk's digest as it arrives. A stored item that
several ranks of one node need (replicated state: DDP, or unsharded buffers under FSDP) is read by
one of them and broadcast over the node's gloo group.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import io
import math
import pickle
import threading
import uuid
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import _split_by_size_and_type, _StorageInfo, _StoragePrefix
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, SavePlan, WriteItemType
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult

from components.core.checkpoint.layout import METADATA
from components.core.checkpoint.verify import ChunkDigests, chunk_spans, digest
from components.core.errors import CorruptCheckpoint
from components.core.storage import Store

DCP_SUFFIX = ".distcp"


def raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous CPU tensor as a flat uint8 view (no copy)."""
    return tensor.reshape(-1).view(torch.uint8)


def _buffer(view: torch.Tensor) -> memoryview:
    return memoryview(view.numpy()) if view.numel() else memoryview(b"")


# ------------------------------------------------------------------------------------ writing

class StoreWriter(StorageWriter):
    """Writes one checkpoint directory ``key`` of ``store``; ``files`` holds, after ``dcp.save``,
    the size and chunk digests of every file this rank wrote (and ``.metadata`` on the coordinator)."""

    def __init__(self, store: Store, key: str, *, files_per_rank: int = 1):
        super().__init__()
        self.store, self.key, self.files_per_rank = store, key, max(1, files_per_rank)
        self.files: dict[str, dict[str, Any]] = {}
        self.save_id = uuid.uuid4().hex
        self._lock = threading.Lock()

    def reset(self, checkpoint_id: Any = None) -> None:
        self.save_id = uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [dataclasses.replace(p, storage_data=_StoragePrefix(f"__{i}_")) for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: Any) -> torch.futures.Future:
        prefix = plan.storage_data.prefix
        buckets = [b for b in _split_by_size_and_type(self.files_per_rank, plan.items) if b]
        names = [f"{prefix}{n}{DCP_SUFFIX}" for n in range(len(buckets))]
        if len(buckets) > 1:
            with concurrent.futures.ThreadPoolExecutor(len(buckets)) as pool:
                parts = list(pool.map(lambda nb: self._write_file(nb[0], nb[1], planner), zip(names, buckets)))
        else:
            parts = [self._write_file(n, b, planner) for n, b in zip(names, buckets)]
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result([r for part in parts for r in part])
        return fut

    def _write_file(self, name: str, items: list[Any], planner: Any) -> list[WriteResult]:
        writer = self.store.open_writer(f"{self.key}/{name}")
        offset, chunks, results = 0, [], []
        try:
            ordered = [i for i in items if i.type == WriteItemType.BYTE_IO] + \
                      [i for i in items if i.type != WriteItemType.BYTE_IO]
            for item in ordered:
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    view = data.getbuffer()
                else:
                    tensor = data.detach()
                    if tensor.device.type != "cpu":
                        tensor = tensor.cpu()
                    view = _buffer(raw_bytes(tensor.contiguous()))
                length = len(view)
                for start, n in chunk_spans(0, length):
                    piece = view[start:start + n]
                    chunks.append([offset + start, n, digest(piece)])
                    writer.write(piece)
                results.append(WriteResult(index=item.index, size_in_bytes=length,
                                           storage_data=_StorageInfo(name, offset, length)))
                offset += length
            writer.close()
        except BaseException:
            writer.abort()
            raise
        with self._lock:
            self.files[name] = {"size": offset, "chunks": chunks}
        return results

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.storage_data = {wr.index: wr.storage_data for part in results for wr in part}
        metadata.storage_meta = self.storage_meta()
        body = pickle.dumps(metadata)
        self.store.write_bytes(f"{self.key}/{METADATA}", body)
        self.files[METADATA] = {"size": len(body), "chunks": [[0, len(body), digest(body)]]}

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.store.uri_for(self.key), save_id=self.save_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False


# ------------------------------------------------------------------------------------ reading

@dataclasses.dataclass
class _Item:
    """One stored item this rank needs: where its bytes go, and the requests it serves."""

    index: Any
    info: _StorageInfo
    reqs: list[Any]
    is_bytes: bool
    dest: torch.Tensor | None = None  # tensors: the stored chunk (or the request's target itself)
    direct: bool = False
    raw: torch.Tensor | None = None  # the stored bytes (uint8)


class StoreReader(StorageReader):
    """Reads checkpoint ``key`` of ``store`` for one rank (see the module doc).

    Args:
        metadata: the checkpoint's DCP metadata (already read and checked once by the caller).
        digests: the manifest's chunk digests.
        node_group: this rank's node group (gloo) and the global ranks of each node, for reading
            replicated items once per node; None reads everything itself.
        threads: ranged reads in flight at once.
    """

    def __init__(self, store: Store, key: str, metadata: Metadata, digests: ChunkDigests, *,
                 node_group: Any = None, node_ranks: list[list[int]] | None = None, threads: int = 4):
        super().__init__()
        self.store, self.key, self.metadata, self.digests = store, key, metadata, digests
        self.node_group, self.node_ranks, self.threads = node_group, node_ranks, max(1, threads)
        self.storage_data: dict[Any, Any] = {}
        self.rank = 0
        self.load_id = uuid.uuid4().hex

    def reset(self, checkpoint_id: Any = None) -> None:
        self.load_id = uuid.uuid4().hex

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if getattr(self.metadata, "storage_meta", None) is None:
            self.metadata.storage_meta = StorageMeta()
        self.metadata.storage_meta.load_id = self.load_id
        return self.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.storage_data = metadata.storage_data
        self.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Per node, each stored item that two or more of its ranks need gets one reader (the lowest
        of them); every rank of the node learns the node's ``[(item, reader)]`` list."""
        if not self.node_ranks:
            return plans
        out = list(plans)
        for ranks in self.node_ranks:
            needers: dict[Any, list[int]] = {}
            for r in ranks:
                if r < len(plans):
                    for req in plans[r].items:
                        rs = needers.setdefault(req.storage_index, [])
                        if r not in rs:
                            rs.append(r)
            shared = sorted(((index, min(rs)) for index, rs in needers.items() if len(rs) > 1),
                            key=lambda x: (self.storage_data[x[0]].relative_path, self.storage_data[x[0]].offset))
            for r in ranks:
                if r < len(plans):
                    out[r] = dataclasses.replace(plans[r], storage_data=shared)
        return out

    def read_data(self, plan: LoadPlan, planner: Any) -> torch.futures.Future:
        shared = {index: reader for index, reader in (plan.storage_data or [])}
        items: dict[Any, _Item] = {}
        for req in plan.items:
            info = self.storage_data[req.storage_index]
            if getattr(info, "transform_descriptors", None):
                raise CorruptCheckpoint(f"{self.digests.uri}/{info.relative_path}: stream transforms are not "
                                        f"part of checkpoint format 2")
            item = items.setdefault(req.storage_index, _Item(req.storage_index, info, [],
                                                             req.type == LoadItemType.BYTE_IO))
            item.reqs.append(req)
        error: BaseException | None = None
        try:
            for item in items.values():
                self._place(item, planner)
            self._read_all([it for index, it in items.items() if shared.get(index, self.rank) == self.rank])
        except BaseException as err:  # noqa: BLE001 - the node must hear of it before any broadcast
            error = err
        if shared and self.node_group is not None:
            self._agree_in_node(error)
            self._broadcast(shared, items)
        elif error is not None:
            raise error
        for item in sorted(items.values(), key=lambda it: (it.info.relative_path, it.info.offset)):
            self._deliver(item, planner)
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(None)
        return fut

    # -- helpers
    def _place(self, item: _Item, planner: Any) -> None:
        """Where the bytes of ``item`` land: its only target tensor when that has the stored chunk's
        exact shape, dtype and layout on CPU, else a fresh buffer of the stored chunk."""
        length = item.info.length
        if item.is_bytes:
            item.raw = torch.empty(length, dtype=torch.uint8)
            return
        meta = self.metadata.state_dict_metadata[item.index.fqn]
        chunk = _stored_chunk(meta, item.index)
        dtype = meta.properties.dtype
        shape = torch.Size(chunk.sizes)
        if math.prod(shape) * torch._utils._element_size(dtype) != length:
            raise CorruptCheckpoint(f"{self.digests.uri}/{item.info.relative_path}: item {item.index.fqn!r} has "
                                    f"{length} bytes, its metadata says {tuple(shape)} x {dtype}")
        if len(item.reqs) == 1:
            req = item.reqs[0]
            target = planner.resolve_tensor(req).detach()
            if (not any(req.storage_offsets) and tuple(req.lengths) == tuple(shape) and target.device.type == "cpu"
                    and target.dtype == dtype and target.shape == shape and target.is_contiguous()):
                item.dest, item.direct = target, True
        if item.dest is None:
            item.dest = torch.empty(shape, dtype=dtype)
        item.raw = raw_bytes(item.dest) if item.dest.numel() else torch.empty(0, dtype=torch.uint8)

    def _read_all(self, items: list[_Item]) -> None:
        pieces = []
        for item in items:
            base = item.info.offset
            for offset, n in chunk_spans(base, item.info.length):
                pieces.append((item.info.relative_path, offset, item.raw[offset - base: offset - base + n]))
        if not pieces:
            return

        def read(piece: tuple[str, int, torch.Tensor]) -> None:
            name, offset, view = piece
            buf = _buffer(view)
            try:
                self.store.read_into(f"{self.key}/{name}", offset, buf)
            except FileNotFoundError:
                raise CorruptCheckpoint(f"{self.digests.uri}/{name} is missing") from None
            except EOFError:
                raise CorruptCheckpoint(f"{self.digests.uri}/{name} is shorter than its metadata says "
                                        f"(truncated?)") from None
            self.digests.check(name, offset, buf)

        if len(pieces) == 1 or self.threads == 1:
            for p in pieces:
                read(p)
            return
        with concurrent.futures.ThreadPoolExecutor(min(self.threads, len(pieces))) as pool:
            for f in [pool.submit(read, p) for p in pieces]:
                f.result()

    def _agree_in_node(self, error: BaseException | None) -> None:
        outcomes: list[Any] = [None] * dist.get_world_size(self.node_group)
        mine = None if error is None else (type(error).__name__, str(error))
        dist.all_gather_object(outcomes, mine, group=self.node_group)
        if error is not None:
            raise error
        for outcome in outcomes:
            if outcome is not None:
                raise CorruptCheckpoint(f"a rank of this node could not read the checkpoint: {outcome[1]}")

    def _broadcast(self, shared: dict[Any, int], items: dict[Any, _Item]) -> None:
        for index, reader in shared.items():  # the same order on every rank of the node
            length = self.storage_data[index].length
            if not length:
                continue
            item = items.get(index)
            buf = item.raw if item is not None else torch.empty(length, dtype=torch.uint8)
            dist.broadcast(buf, src=reader, group=self.node_group)

    def _deliver(self, item: _Item, planner: Any) -> None:
        from torch.distributed._shard._utils import narrow_tensor_by_index

        if item.is_bytes:
            data = bytes(_buffer(item.raw))
            for req in item.reqs:
                planner.load_bytes(req, io.BytesIO(data))
            return
        for req in item.reqs:
            if item.direct:
                planner.commit_tensor(req, item.dest)
                continue
            source = narrow_tensor_by_index(item.dest, req.storage_offsets, req.lengths)
            target = planner.resolve_tensor(req).detach()
            if target.size() != source.size():
                raise CorruptCheckpoint(f"{self.digests.uri}: item {req.storage_index.fqn!r} does not fit its "
                                        f"destination ({tuple(source.size())} vs {tuple(target.size())})")
            target.copy_(source)
            planner.commit_tensor(req, target)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False


def _stored_chunk(meta: Any, index: Any) -> Any:
    chunks = meta.chunks
    hint = getattr(index, "index", None)
    if hint is not None and 0 <= hint < len(chunks) and torch.Size(chunks[hint].offsets) == index.offset:
        return chunks[hint]
    for chunk in chunks:
        if torch.Size(chunk.offsets) == index.offset:
            return chunk
    raise CorruptCheckpoint(f"checkpoint metadata has no chunk of {index.fqn!r} at offset {tuple(index.offset or ())}")


# ------------------------------------------------------------------------------------ planners

def safe_load_planner():
    """DCP's default load planner, except that non-tensor values load with
    ``torch.load(weights_only=True)``, never a full unpickle."""
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class SafeLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value) -> None:
            try:
                obj = torch.load(value, weights_only=True)
            except Exception as err:  # noqa: BLE001 - any unpickling refusal means an unsafe item
                raise CorruptCheckpoint(f"checkpoint item {read_item.dest_index.fqn!r} is not safely "
                                        f"loadable (weights_only): {str(err).splitlines()[0][:200]}") from None
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return SafeLoadPlanner()
