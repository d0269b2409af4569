"""DCP straight against relaunch's Store (format 3): no staging copy, integrity in the same pass.

:class:`StoreWriter` streams each rank's items into ``__<rank>_<n>.distcp`` through
``Store.open_writer`` (a file written in place, or a streaming S3 multipart upload) in the layout of
DCP's own ``FileSystemWriter``, so that stock ``torch.distributed.checkpoint`` reads the checkpoint:
a tensor item is a ``torch.save`` archive of the tensor (its bytes written by torch straight from the
tensor's memory, never copied into a buffer), a bytes item what DCP serialised. Each file is cut
into chunks whose XXH3-128 digests are taken while writing: each tensor's payload (the archive's
uncompressed ``data/0`` record) in chunks of at most ``CHUNK_BYTES`` starting at the payload, and
the archive bytes around payloads as chunks of their own. ``files`` returns them for the manifest
with each payload's offset (``payloads``), so a reader finds a tensor's bytes without parsing zip.

:class:`StoreReader` reads exactly the byte ranges its rank's load plan names (a part of a stored
tensor's payload when resharding), merged per file into ranged reads of whole chunks
(``Store.read_into``, in parallel) that fill the destination tensors themselves when they are
contiguous CPU tensors of the stored dtype, and feeds every block to its chunk's digest as it
arrives. A stored item that several ranks of one node need whole (replicated state: DDP, or
unsharded buffers under FSDP) is read by one of them and broadcast over the node's gloo group
(items under ``PACK_BYTES`` in one packed broadcast per reader).
Format 2 (raw bytes at the offsets of ``.metadata``, no archives) is read by the same reader.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import errno
import io
import math
import os
import pickle
import threading
import uuid
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.utils.serialization  # noqa: F401 - torch.load imports it at its first call: inside a restore else
import xxhash  # noqa: F401 - every save and load digests with it (verify.py imports it late, to stay light)
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, SavePlan, WriteItemType
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult

from relaunch.components.core.checkpoint import verify
from relaunch.components.core.checkpoint.layout import METADATA
from relaunch.components.core.checkpoint.torch_private import storage_info
from relaunch.components.core.checkpoint.verify import REQUEST_BYTES, ChunkDigests, digest
from relaunch.components.core.contract.classify import classify, dcp_mismatch, unwritable_cause
from relaunch.components.core.contract.errors import BadInput, CorruptCheckpoint
from relaunch.components.core.contract.exitcodes import ExitCode
from relaunch.components.core.store import Store

DCP_SUFFIX = ".distcp"
PACK_BYTES = 1 << 20  # shared items smaller than this are broadcast packed together
# How far a merged read may run past REQUEST_BYTES: a file the writer filled with FILE_BYTES of tensor bytes
# is that plus its archive records (~1.2 KB per tensor), so a file read whole is one request (one GET)
# instead of a full one and a few-KB tail (on moto, each ranged GET of part of an object reads all of it).
REQUEST_SLACK = REQUEST_BYTES // 16


def raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous CPU tensor as a flat uint8 view (no copy)."""
    return tensor.reshape(-1).view(torch.uint8)


def _buffer(view: torch.Tensor) -> memoryview:
    return memoryview(view.numpy()) if view.numel() else memoryview(b"")


# ------------------------------------------------------------------------------------ writing

def _address(view: memoryview) -> int:
    import numpy

    return numpy.frombuffer(view, dtype=numpy.uint8).ctypes.data


class DataFile:
    """One data file of format 3 on its way to ``writer`` (a ``Store`` stream writer): items appended
    in DCP's ``FileSystemWriter`` layout, chunk digests and payload offsets taken on the way.

    ``torch.save`` writes a tensor's archive through :meth:`write`: the small zip and pickle records
    one by one, and the payload (the tensor's bytes) as memory views of the tensor itself, which are
    recognised by their address, digested in chunks starting at the payload and handed to the
    store as they are (no copy into a buffer). torch computes the zip's crc32 of each record as
    usual (~7 GB/s), so that every zip tool, not only torch, accepts the archives."""

    def __init__(self, writer: Any):
        import xxhash

        self.writer = writer
        self.pos = 0
        self.chunks: list[list[Any]] = []
        self.payloads: list[list[int]] = []  # [item offset, payload offset] of each non-empty tensor
        self._start = 0  # where the chunk being digested began
        self._hasher = xxhash.xxh3_128()
        self._payload: list[int] | None = None  # [address, nbytes, bytes seen, payload offset]

    def _cut(self) -> None:
        if self.pos > self._start:
            self.chunks.append([self._start, self.pos - self._start, self._hasher.hexdigest()])
            self._hasher.reset()
        self._start = self.pos

    def _put(self, view: memoryview, *, chunked: bool) -> None:
        n, at = len(view), 0
        while at < n:
            take = n - at
            if chunked:
                take = min(take, verify.CHUNK_BYTES - (self.pos - self._start))
            piece = view[at:at + take]
            self._hasher.update(piece)
            self.writer.write(piece)
            self.pos += take
            at += take
            if chunked and self.pos - self._start >= verify.CHUNK_BYTES:
                self._cut()

    def write(self, data: Any) -> int:
        """The file-object side ``torch.save`` writes to."""
        view = memoryview(data).cast("B")
        n = len(view)
        p = self._payload
        if p is not None and n and p[2] < p[1] and _address(view) == p[0] + p[2]:
            if p[2] == 0:
                self._cut()
                p[3] = self.pos
            self._put(view, chunked=True)
            p[2] += n
            if p[2] >= p[1]:
                self._cut()
        else:
            self._put(view, chunked=False)
        return n

    def flush(self) -> None:
        pass

    def add_bytes(self, buffer: Any) -> None:
        """A bytes item, as DCP serialised it, in chunks of its own."""
        self._cut()
        self._put(memoryview(buffer).cast("B"), chunked=True)
        self._cut()

    def add_tensor(self, tensor: torch.Tensor) -> None:
        """A tensor item: ``torch.save`` of a plain contiguous tensor whose storage is exactly its bytes."""
        offset = self.pos
        tensor = tensor.contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes:
            flat = raw_bytes(tensor)
            # a tensor of its own over the same memory: torch.save writes a view's whole storage
            saved = torch.frombuffer(_buffer(flat), dtype=torch.uint8).view(tensor.dtype).reshape(tensor.shape)
            self._payload = [flat.data_ptr(), nbytes, 0, -1]
        else:
            saved = torch.empty(tensor.shape, dtype=tensor.dtype)
        try:
            torch.save(saved, self)
        finally:
            payload, self._payload = self._payload, None
        if nbytes:
            if payload is None or payload[2] != nbytes:
                raise RuntimeError(f"torch {torch.__version__} did not write a tensor's bytes in place inside "
                                   f"torch.save; relaunch checkpoint format 3 needs it to (see dcp_io.DataFile)")
            self.payloads.append([offset, payload[3]])

    def close(self) -> None:
        """Digest the last chunk and close the writer (the file is complete in the store)."""
        self._cut()
        self.writer.close()

    def record(self) -> dict[str, Any]:
        """The file's entry in the manifest's ``files``."""
        return {"size": self.pos, "chunks": self.chunks, "payloads": self.payloads}


def write_failure(store: Store, key: str, err: Exception, left: int) -> BaseException:
    """What the failed write of ``key`` raises, so that every rank learns the real cause (DCP carries
    each rank's error to the others pickled, without its ``__context__``): the ``OSError`` of a full or
    read-only store that ``err`` wraps (torch's zip writer raises ``RuntimeError: unexpected pos`` over
    the ``ENOSPC`` of a disk that filled in the middle of a tensor); for an error without an errno that
    no adapter classifies (it would be a bug), an ``ENOSPC`` when the store says it has less room than
    the ``left`` bytes of the item being written (``free_bytes``, where the store can tell: a
    filesystem's ``statvfs``); else ``err`` itself."""
    cause = unwritable_cause(err)
    if cause is not None:
        return cause
    if classify(err) != ExitCode.BUG:
        return err
    free_bytes = getattr(store, "free_bytes", None)  # a store that can tell its free space (a filesystem)
    free = free_bytes(key) if callable(free_bytes) else None
    if free is not None and free < max(left, 0) + FULL_SLACK_BYTES:
        return OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} ({free} bytes free, {max(left, 0)} more to "
                                     f"write; the write failed with {type(err).__name__}: "
                                     f"{str(err).splitlines()[0][:200] if str(err) else ''})", store.uri_for(key))
    return err


FULL_SLACK_BYTES = 64 * 1024
"""A store with less room than an item's bytes still to write plus this (its archive's records, a page
or two of a filesystem's own) cannot take the item: a write that failed without an errno there failed
because the store is full."""


def split_by_size_and_type(bins: int, items: list[Any]) -> list[list[Any]]:
    """``items`` dealt into ``bins`` lists as DCP's ``FileSystemWriter`` deals a rank's items into its
    files: the bytes items in turn, then each tensor item, largest first, to the list with the fewest
    bytes so far (the first such list on a tie)."""
    if bins == 1:
        return [items]
    buckets: list[list[Any]] = [[] for _ in range(bins)]
    sizes = [0] * bins
    byte_items = [i for i in items if i.type == WriteItemType.BYTE_IO]
    tensor_items = sorted((i for i in items if i.type != WriteItemType.BYTE_IO), key=_item_bytes, reverse=True)
    for n, item in enumerate(byte_items):
        buckets[n % bins].append(item)
    for item in tensor_items:
        smallest = sizes.index(min(sizes))
        buckets[smallest].append(item)
        sizes[smallest] += _item_bytes(item)
    return buckets


def _item_bytes(item: Any) -> int:
    return math.prod(item.tensor_data.size) * item.tensor_data.properties.dtype.itemsize


class StoreWriter(StorageWriter):
    """Writes one checkpoint directory ``key`` of ``store``; ``files`` holds, after ``dcp.save``,
    the size and chunk digests of every file this rank wrote (and ``.metadata`` on the coordinator)."""

    def __init__(self, store: Store, key: str, *, files_per_rank: int = 1, threads: int = 4):
        super().__init__()
        self.store, self.key, self.files_per_rank = store, key, max(1, files_per_rank)
        self.threads = max(1, threads)
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
        return [dataclasses.replace(p, storage_data=f"__{i}_") for i, p in enumerate(plans)]  # file prefix

    def write_data(self, plan: SavePlan, planner: Any) -> torch.futures.Future:
        prefix = plan.storage_data
        buckets = [b for b in split_by_size_and_type(self.files_per_rank, plan.items) if b]
        names = [f"{prefix}{n}{DCP_SUFFIX}" for n in range(len(buckets))]
        if len(buckets) > 1:
            with concurrent.futures.ThreadPoolExecutor(min(self.threads, len(buckets))) as pool:
                parts = list(pool.map(lambda nb: self._write_file(nb[0], nb[1], planner), zip(names, buckets)))
        else:
            parts = [self._write_file(n, b, planner) for n, b in zip(names, buckets)]
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result([r for part in parts for r in part])
        return fut

    def _write_file(self, name: str, items: list[Any], planner: Any) -> list[WriteResult]:
        out = DataFile(self.store.open_writer(f"{self.key}/{name}"))
        results = []
        item, offset = None, 0  # the item being written, where it began
        try:
            ordered = [i for i in items if i.type == WriteItemType.BYTE_IO] + \
                      [i for i in items if i.type != WriteItemType.BYTE_IO]
            for item in ordered:
                data = planner.resolve_data(item)
                offset = out.pos
                if item.type == WriteItemType.BYTE_IO:
                    out.add_bytes(data.getbuffer())
                else:
                    tensor = data.detach()
                    if tensor.device.type != "cpu":
                        tensor = tensor.cpu()
                    out.add_tensor(tensor)
                results.append(WriteResult(index=item.index, size_in_bytes=out.pos - offset,
                                           storage_data=storage_info(name, offset, out.pos - offset)))
            out.close()
        except Exception as err:
            out.writer.abort()
            size = _item_bytes(item) if item is not None and item.type != WriteItemType.BYTE_IO else 0
            failure = write_failure(self.store, f"{self.key}/{name}", err, size - (out.pos - offset))
            if failure is err:
                raise
            raise failure from (err if failure.__traceback__ is None else None)  # a wrapped OSError: raised itself
        except BaseException:
            out.writer.abort()
            raise
        with self._lock:
            self.files[name] = out.record()
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
class _Part:
    """One load request of this rank: the bytes ``[start, end)`` of file ``name`` it needs, where they
    land (``buf``, flat uint8) and, unless they land in the target itself, how to view them."""

    reqs: list[Any]
    name: str
    start: int
    end: int
    buf: torch.Tensor
    source: torch.Tensor | None = None  # tensors read into a buffer: the request's region of it
    is_bytes: bool = False
    extent: tuple[int, int] | None = None  # the bytes to read and check when more than [start, end)
    target: torch.Tensor | None = None  # the destination, resolved once (DCP's lookup costs ~10 us an item)


class StoreReader(StorageReader):
    """Reads checkpoint ``key`` of ``store`` for one rank (see the module doc).

    Args:
        metadata: the checkpoint's DCP metadata (already read and checked once by the caller).
        digests: the manifest's chunk digests.
        payloads: format 3: where each tensor item's bytes start, ``{(file, item offset): payload
            offset}`` (:func:`payload_offsets` of the manifest); None for format 2 (raw items).
        node_group: this rank's node group (gloo) and the global ranks of each node, for reading
            replicated items once per node; None reads everything itself.
        threads: ranged reads in flight at once.
    """

    def __init__(self, store: Store, key: str, metadata: Metadata, digests: ChunkDigests, *,
                 payloads: dict[tuple[str, int], int] | None = None,
                 node_group: Any = None, node_ranks: list[list[int]] | None = None, threads: int = 4):
        super().__init__()
        self.store, self.key, self.metadata, self.digests = store, key, metadata, digests
        self.payloads = payloads
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

    def _whole(self, req: Any) -> bool:
        if req.type == LoadItemType.BYTE_IO:
            return True
        chunk = _stored_chunk(self.metadata.state_dict_metadata[req.storage_index.fqn], req.storage_index)
        return not any(req.storage_offsets) and tuple(req.lengths) == tuple(chunk.sizes)

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Per node, each stored item that two or more of its ranks need whole (replicated state)
        gets one reader (the lowest of them); every rank of the node learns the node's
        ``[(item, reader)]`` list. Items that ranks need parts of (shards being resharded) are
        read by each rank for its own part."""
        if not self.node_ranks:
            return plans
        out = list(plans)
        for ranks in self.node_ranks:
            needers: dict[Any, list[int]] = {}
            partial: set[Any] = set()
            for r in ranks:
                if r < len(plans):
                    counts: dict[Any, int] = {}
                    for req in plans[r].items:
                        counts[req.storage_index] = counts.get(req.storage_index, 0) + 1
                        if not self._whole(req):
                            partial.add(req.storage_index)
                    for index, count in counts.items():
                        if count > 1:
                            partial.add(index)
                        rs = needers.setdefault(index, [])
                        if r not in rs:
                            rs.append(r)
            shared = sorted(((index, min(rs)) for index, rs in needers.items() if len(rs) > 1 and index not in partial),
                            key=lambda x: (self.storage_data[x[0]].relative_path, self.storage_data[x[0]].offset))
            for r in ranks:
                if r < len(plans):
                    out[r] = dataclasses.replace(plans[r], storage_data=shared)
        return out

    def read_data(self, plan: LoadPlan, planner: Any) -> torch.futures.Future:
        shared = {index: reader for index, reader in (plan.storage_data or [])}
        parts: list[_Part] = []
        by_index: dict[Any, _Part] = {}
        for req in plan.items:
            info = self.storage_data[req.storage_index]
            if getattr(info, "transform_descriptors", None):
                raise CorruptCheckpoint(f"{self.digests.uri}/{info.relative_path}: stream transforms are not "
                                        f"part of relaunch's checkpoint formats")
            if req.type == LoadItemType.BYTE_IO and req.storage_index in by_index:
                by_index[req.storage_index].reqs.append(req)
                continue
            part = self._part(req, info, planner)
            by_index.setdefault(req.storage_index, part)
            parts.append(part)
        error: BaseException | None = None
        try:
            self._read_all([p for p in parts if shared.get(p.reqs[0].storage_index, self.rank) == self.rank])
        except BaseException as err:  # noqa: BLE001 - the node must hear of it before any broadcast
            error = err
        if shared and self.node_group is not None:
            self._agree_in_node(error)
            self._broadcast(shared, by_index)
        elif error is not None:
            raise error
        for part in sorted(parts, key=lambda p: (p.name, p.start)):
            self._deliver(part, planner)
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(None)
        return fut

    # -- helpers
    def _part(self, req: Any, info: Any, planner: Any) -> _Part:
        """The bytes request ``req`` needs and where they land: straight in its target tensor when
        they are one contiguous range of the stored item and the target is a contiguous CPU tensor
        of the stored dtype; else a buffer of the smallest range holding them, copied afterwards."""
        name = info.relative_path
        if req.type == LoadItemType.BYTE_IO:
            return _Part([req], name, info.offset, info.offset + info.length,
                         torch.empty(info.length, dtype=torch.uint8), is_bytes=True)
        meta = self.metadata.state_dict_metadata[req.storage_index.fqn]
        chunk = _stored_chunk(meta, req.storage_index)
        dtype = meta.properties.dtype
        shape = torch.Size(chunk.sizes)
        size = dtype.itemsize
        base = self._payload_offset(req.storage_index, info, math.prod(shape) * size, shape, dtype)
        target = planner.resolve_tensor(req).detach()
        lengths = torch.Size(req.lengths)
        if target.size() != lengths:
            raise CorruptCheckpoint(f"{self.digests.uri}: item {req.storage_index.fqn!r} does not fit its "
                                    f"destination ({tuple(lengths)} vs {tuple(target.size())})")
        strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
        numel = math.prod(lengths)
        # a whole format-3 item is read with its archive's records around the payload, so that
        # every byte of what a load needs whole is checked (what stock torch would read too)
        whole = self.payloads is not None and not any(req.storage_offsets) and lengths == shape
        extent = (info.offset, info.offset + info.length) if whole else None
        if numel == 0:
            return _Part([req], name, base, base, torch.empty(0, dtype=torch.uint8),
                         source=torch.empty(lengths, dtype=dtype), extent=extent)
        first = sum(o * s for o, s in zip(req.storage_offsets, strides))
        last = sum((o + n - 1) * s for o, n, s in zip(req.storage_offsets, lengths, strides))
        start, end = base + first * size, base + (last + 1) * size
        if (last + 1 - first == numel and target.device.type == "cpu" and target.dtype == dtype
                and target.is_contiguous()):
            return _Part([req], name, start, end, raw_bytes(target), extent=extent, target=target)
        region = torch.empty(last + 1 - first, dtype=dtype)
        return _Part([req], name, start, end, raw_bytes(region), source=region.as_strided(lengths, strides, 0),
                     extent=extent, target=target)

    def _payload_offset(self, index: Any, info: Any, nbytes: int, shape: Any, dtype: Any) -> int:
        """Where the bytes of tensor item ``index`` start in its file: the item itself (format 2), or
        its archive's payload as the manifest records it (format 3), checked to lie inside the item."""
        name = info.relative_path
        if self.payloads is None:
            if nbytes != info.length:
                raise CorruptCheckpoint(f"{self.digests.uri}/{name}: item {index.fqn!r} has {info.length} "
                                        f"bytes, its metadata says {tuple(shape)} x {dtype}")
            return info.offset
        if not nbytes:
            return info.offset
        base = self.payloads.get((name, info.offset))
        if base is None or base < info.offset or base + nbytes > info.offset + info.length:
            raise CorruptCheckpoint(f"{self.digests.uri}/{name}: the manifest records no payload of "
                                    f"{tuple(shape)} x {dtype} inside item {index.fqn!r} (bytes "
                                    f"{info.offset}..{info.offset + info.length})")
        return base

    def _item_bytes(self, index: Any) -> int:
        """The bytes a whole read of item ``index`` fills: its tensor's, or the bytes item's."""
        meta = self.metadata.state_dict_metadata[index.fqn]
        if not hasattr(meta, "chunks"):
            return self.storage_data[index].length
        return math.prod(_stored_chunk(meta, index).sizes) * meta.properties.dtype.itemsize

    def _read_all(self, parts: list[_Part]) -> None:
        """Each file's parts, by offset, merged into ranged reads of whole chunks (at most
        REQUEST_BYTES + REQUEST_SLACK, or the largest part's + REQUEST_SLACK when one part is over the
        cap) whose bytes between and around the parts go to scratch."""
        by_file: dict[str, list[_Part]] = {}
        for p in parts:
            if (p.extent or (p.start, p.end))[1] > (p.extent or (p.start, p.end))[0]:
                by_file.setdefault(p.name, []).append(p)
        reads: list[tuple[str, int, list[Any]]] = []
        for name, file_parts in by_file.items():
            file_parts.sort(key=lambda p: (p.start, p.end))
            current: list[Any] = []
            first = data_end = chunk_end = largest = 0
            for p in file_parts:
                chunks = self.digests.covering(name, *(p.extent or (p.start, p.end)))
                lo, hi = chunks[0][0], chunks[-1][0] + chunks[-1][1]
                # a part over the cap is one request anyway: the small items around it ride along in it
                # (one range for a file's leading records and its payload, not a small one and a large one)
                fits = max(hi, chunk_end) - first <= max(REQUEST_BYTES, largest, hi - lo) + REQUEST_SLACK
                if current and lo <= chunk_end and p.start >= data_end and fits:
                    current += [bytearray(p.start - data_end), p.buf]
                    chunk_end = max(chunk_end, hi)
                    largest = max(largest, hi - lo)
                else:
                    if current:
                        current.append(bytearray(chunk_end - data_end))
                        reads.append((name, first, current))
                    current, first, chunk_end, largest = [bytearray(p.start - lo), p.buf], lo, hi, hi - lo
                data_end = p.end
            if current:
                current.append(bytearray(chunk_end - data_end))
                reads.append((name, first, current))
        if not reads:
            return

        def read(job: tuple[str, int, list[Any]]) -> None:
            name, first, buffers = job
            self.digests.read(self.store, self.key, name, first, [_buffer(b) if isinstance(b, torch.Tensor) else b
                                                                  for b in buffers])

        reads.sort(key=lambda r: -sum(len(b) if not isinstance(b, torch.Tensor) else b.numel() for b in r[2]))
        if len(reads) == 1 or self.threads == 1:
            for r in reads:
                read(r)
            return
        with concurrent.futures.ThreadPoolExecutor(min(self.threads, len(reads))) as pool:
            for f in [pool.submit(read, r) for r in reads]:
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

    def _broadcast(self, shared: dict[Any, int], by_index: dict[Any, _Part]) -> None:
        """Each shared item from its reader to the node: items of at least PACK_BYTES one broadcast
        each, straight from and into their buffers; the smaller ones (step counters, hyperparameters,
        RNG states: a gloo collective each cost ~1 ms, 25 ms a load) packed into one buffer per reader."""
        packs: dict[int, list[tuple[int, _Part | None]]] = {}
        for index, reader in shared.items():  # the same order on every rank of the node
            length = self._item_bytes(index)
            if not length:
                continue
            part = by_index.get(index)
            if length < PACK_BYTES:
                packs.setdefault(reader, []).append((length, part))
                continue
            buf = part.buf if part is not None else torch.empty(length, dtype=torch.uint8)
            dist.broadcast(buf, src=reader, group=self.node_group)
        for reader, items in packs.items():
            if reader == self.rank:
                flat = torch.cat([part.buf for _, part in items]) if len(items) > 1 else items[0][1].buf
                dist.broadcast(flat, src=reader, group=self.node_group)
                continue
            flat = torch.empty(sum(length for length, _ in items), dtype=torch.uint8)
            dist.broadcast(flat, src=reader, group=self.node_group)
            at = 0
            for length, part in items:
                if part is not None:
                    part.buf.copy_(flat[at:at + length])
                at += length

    def _deliver(self, part: _Part, planner: Any) -> None:
        if part.is_bytes:
            data = bytes(_buffer(part.buf))
            for req in part.reqs:
                planner.load_bytes(req, io.BytesIO(data))
            return
        req = part.reqs[0]
        target = part.target if part.target is not None else planner.resolve_tensor(req).detach()
        if part.source is not None:
            target.copy_(part.source)
        planner.commit_tensor(req, target)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False


def payload_offsets(files: dict[str, dict[str, Any]]) -> dict[tuple[str, int], int]:
    """``{(file, item offset): payload offset}`` from a format-3 manifest's ``files``.

    Raises:
        CorruptCheckpoint: a ``payloads`` entry that is not a list of integer pairs.
    """
    out: dict[tuple[str, int], int] = {}
    for name, meta in files.items():
        for entry in meta.get("payloads", []):
            if not (isinstance(entry, list) and len(entry) == 2 and all(type(v) is int for v in entry)):
                raise CorruptCheckpoint(f"the manifest's payloads of {name!r} are malformed: {entry!r}")
            out[(name, entry[0])] = entry[1]
    return out


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
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class SafeLoadPlanner(DefaultLoadPlanner):
        def create_local_plan(self):
            # DCP says "Missing key"/"Size mismatch" only in a bare RuntimeError/ValueError's text
            why = None if self.allow_partial_load else dcp_mismatch(self.state_dict, self.metadata)
            if why:
                raise BadInput(why)
            unasked = set(self.metadata.state_dict_metadata) - set(self.state_dict)
            if self.allow_partial_load or any(not key.startswith(("rng.", "data.")) for key in unasked):
                # partial loads and keys this state lacks (DCP then tries torch 2.3's key layout): DCP's
                # way; the only stored keys a TrainingState leaves out are other ranks' RNG streams and loaders
                return super().create_local_plan()
            return fast_local_load_plan(self.state_dict, self.metadata)

        def load_bytes(self, read_item, value) -> None:
            try:
                obj = torch.load(value, weights_only=True)
            except Exception as err:  # noqa: BLE001 - any unpickling refusal means an unsafe item
                raise CorruptCheckpoint(f"checkpoint item {read_item.dest_index.fqn!r} is not safely "
                                        f"loadable (weights_only): {str(err).splitlines()[0][:200]}") from None
            if self.flatten_state_dict:
                place(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return SafeLoadPlanner()


def place(root: dict[str, Any], path: tuple, value: Any) -> None:
    """Put ``value`` into the nested state dict ``root`` at ``path`` (the key path DCP's
    ``flatten_state_dict`` maps a flat key to: strings index dicts, ints index lists), creating the
    dicts and lists on the way that are missing, as DCP's default load planner does."""
    container: Any = root
    for key, next_key in zip(path, path[1:]):
        empty: Any = {} if type(next_key) is str else []
        if isinstance(container, Mapping):
            container = container.setdefault(key, empty)
        else:
            container.extend([None] * (key + 1 - len(container)))
            if container[key] is None:
                container[key] = empty
            container = container[key]
    key = path[-1]
    if type(key) is int:
        container.extend([None] * (key + 1 - len(container)))
    container[key] = value


def shard_chunk(global_shape: Any, mesh_shape: Any, coordinate: Any, placements: Any) -> tuple[list[int], list[int]] | None:
    """(local sizes, global offsets) of this rank's chunk of a DTensor whose placements are all plain
    ``Shard`` or ``Replicate``, by torch.chunk's rule (what DTensor shards by); None for any other
    placement. DTensor's own ``compute_local_shape_and_global_offset`` (torch 2.13) builds a
    ``torch.arange`` of every shard's length to find its offset: at 1 GiB, 34 MB of fresh memory per
    large parameter, faulted page by page, six times per FSDP load (78 ms of a busy 2-rank load)."""
    from torch.distributed.tensor import Replicate, Shard

    sizes, offsets = list(global_shape), [0] * len(global_shape)
    for i, placement in enumerate(placements):
        if type(placement) is Replicate:
            continue
        if type(placement) is not Shard:
            return None
        dim, n, k, r = placement.dim, sizes[placement.dim], mesh_shape[i], coordinate[i]
        full = -(-n // k)
        lo = min(r * full, n)
        sizes[dim], offsets[dim] = max(0, min(n, lo + full) - lo), offsets[dim] + lo
        if not sizes[dim]:
            offsets[dim] = global_shape[dim]  # an empty shard sits at the end of its dim, as in DTensor
    return sizes, offsets


def fast_local_load_plan(state_dict: dict[str, Any], metadata: Metadata) -> LoadPlan:
    """DCP's ``create_default_local_load_plan`` (strict), except that the chunk of a plain-sharded
    DTensor comes from :func:`shard_chunk` (checked against its local tensor's shape), not from
    DTensor's own chunk list (see there), and that a plain tensor stored whole as one chunk gets its
    one read item directly (the item DCP's resharding sweep makes for it, without the sweep: ~12 us an
    item, 4 ms of a 1 GiB AdamW state's load)."""
    from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata
    from torch.distributed.checkpoint.planner import ReadItem
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
    from torch.distributed.tensor import DTensor

    items: list[Any] = []
    for fqn, obj in state_dict.items():
        md = metadata.state_dict_metadata.get(fqn)
        chunk = None
        if isinstance(obj, DTensor) and isinstance(md, TensorStorageMetadata) and md.size == obj.size():
            coordinate = obj.device_mesh.get_coordinate()
            if coordinate is None:
                continue  # not a rank of this DTensor's mesh: nothing to load (as DCP does)
            chunk = shard_chunk(obj.shape, obj.device_mesh.shape, coordinate, obj.placements)
        elif whole_chunk(obj, md):
            zeros = torch.Size([0] * obj.dim())
            items.append(ReadItem(type=LoadItemType.TENSOR, dest_index=MetadataIndex(fqn, zeros, 0),
                                  dest_offsets=zeros, storage_index=MetadataIndex(fqn, md.chunks[0].offsets, 0),
                                  storage_offsets=zeros, lengths=torch.Size(md.size)))
            continue
        if chunk is None or tuple(chunk[0]) != tuple(obj.to_local().shape):
            items += create_default_local_load_plan({fqn: obj}, metadata, True).items
        else:
            items += create_read_items_for_chunk_list(
                fqn, md, [ChunkStorageMetadata(offsets=torch.Size(chunk[1]), sizes=torch.Size(chunk[0]))])
    return LoadPlan(items)


def whole_chunk(obj: Any, md: Any) -> bool:
    """Whether ``obj`` is a plain non-empty tensor of the size ``md`` (its stored metadata) records, stored
    as one chunk at offset 0: its load is one read item of the whole tensor."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return (type(obj) in (torch.Tensor, torch.nn.Parameter) and isinstance(md, TensorStorageMetadata)
            and obj.numel() > 0 and md.size == obj.size() and len(md.chunks) == 1
            and not any(md.chunks[0].offsets) and md.chunks[0].sizes == md.size)
