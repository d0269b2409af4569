"""DCP straight against relaunch's Store (format 3): no staging copy, integrity in the same pass.

:class:`StoreWriter` streams each rank's items into ``__<rank>_<n>.distcp`` through
``Store.open_writer`` (a file written in place, or a streaming S3 multipart upload) in the layout of
DCP's own ``FileSystemWriter``, so that stock ``torch.distributed.checkpoint`` reads the checkpoint:
a tensor item is the ``torch.save`` archive of the tensor, byte for byte (built here from its records
for the dtypes whose archives match torch's, :func:`archive_maker`, ~0.4 ms a tensor less than
``torch.save``; else written by ``torch.save`` itself), a bytes item what DCP serialised. A payload
(the archive's uncompressed ``data/0`` record: the tensor's bytes) of at least ``DIRECT_BYTES`` goes to
the store from the tensor's own memory, in chunks of at most ``CHUNK_BYTES`` starting at it; the smaller
pieces between two such payloads are gathered into writes of about ``PENDING_BYTES`` and chunks of
``SMALL_CHUNK_BYTES``. Every chunk's XXH3-128 digest is taken while writing; ``files`` returns them for
the manifest with each payload's offset (``payloads``), so a reader finds a tensor's bytes without
parsing zip.

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
import contextlib
import dataclasses
import errno
import gc
import io
import math
import os
import pickle
import re
import struct
import threading
import uuid
import zlib
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.utils.serialization  # noqa: F401 - torch.load imports it at its first call: inside a restore else
import xxhash  # noqa: F401 - every save and load digests with it (verify.py imports it late, to stay light)
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, SavePlan, WriteItemType
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult

from . import verify
from .layout import METADATA
from .torch_private import TENSOR_REBUILD_GLOBAL, storage_info
from .verify import REQUEST_BYTES, ChunkDigests, digest
from ..contract.classify import classify, dcp_mismatch, unwritable_cause
from ..contract.errors import BadInput, CorruptCheckpoint
from ..contract.exitcodes import ExitCode
from ..store import Store

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


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a non-empty contiguous CPU tensor, without a copy (one numpy view where numpy has
    the dtype: a third of the cost of :func:`raw_bytes`'s two tensor views, per small tensor)."""
    try:
        return memoryview(tensor.numpy()).cast("B")
    except (TypeError, RuntimeError, ValueError):  # bfloat16 and the like: numpy has no such dtype
        return _buffer(raw_bytes(tensor))


@contextlib.contextmanager
def collector_paused() -> Any:
    """Python's cyclic garbage collector paused inside (reference counting frees as usual). A DCP save
    or load of n tensors makes ~10 n objects that live until it ends, so the collector's full passes on
    the way, each over every object of the process, took ~40 % of the CPU of a 4,096-tensor save here."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


# ------------------------------------------------------------------------------------ writing

def _address(view: memoryview) -> int:
    import numpy

    return numpy.frombuffer(view, dtype=numpy.uint8).ctypes.data


# -- torch.save archives of plain tensors, built here (~20 us a small tensor; torch.save takes ~400)

ARCHIVE_MAX_BYTES = 1 << 31  # larger tensors (a zip64 record) go through torch.save itself
_ALIGN = 64  # torch's writer starts every record's data on this boundary (its ".storage_alignment")


def _pickle_int(n: int) -> bytes:
    """``n >= 0`` as protocol 2 pickles it."""
    if n < 0x100:
        return b"K" + n.to_bytes(1, "little")
    if n < 0x10000:
        return b"M" + n.to_bytes(2, "little")
    if n < 0x80000000:
        return b"J" + n.to_bytes(4, "little")
    raw = n.to_bytes((n.bit_length() >> 3) + 1, "little", signed=True)
    return b"\x8a" + len(raw).to_bytes(1, "little") + raw


def tensor_pickle(storage_type: bytes, shape: tuple[int, ...]) -> bytes:
    """The ``data.pkl`` record of ``torch.save(t)`` for a contiguous CPU tensor ``t`` of ``shape`` whose
    storage is exactly its bytes, not requiring grad, without hooks: what torch's pickler (protocol 2)
    writes for ``_rebuild_tensor_v2((storage, 0, shape, strides, False, OrderedDict()))`` with the
    storage as the persistent id ``('storage', <storage_type>, '0', 'cpu', numel)``."""
    memo = [0]

    def put() -> bytes:
        memo[0] += 1
        return b"q" + (memo[0] - 1).to_bytes(1, "little")

    def tup(values: tuple[int, ...]) -> bytes:
        if not values:
            return b")"  # the empty tuple is never memoised
        body = b"".join(_pickle_int(v) for v in values)
        if len(values) <= 3:
            return body + b"\x85\x86\x87"[len(values) - 1:len(values)] + put()
        return b"(" + body + b"t" + put()

    strides = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    out = [b"\x80\x02" + TENSOR_REBUILD_GLOBAL, put(), b"((X\x07\x00\x00\x00storage", put(),
           b"ctorch\n" + storage_type + b"\n", put(), b"X\x01\x00\x00\x000", put(), b"X\x03\x00\x00\x00cpu", put(),
           _pickle_int(math.prod(shape)), b"t", put(), b"Q", _pickle_int(0)]
    out += [tup(shape), tup(strides), b"\x89ccollections\nOrderedDict\n", put(), b")R", put(), b"t", put(), b"R",
            put(), b"."]
    return b"".join(out)


def _hash_combine(seed: int, value: int) -> int:
    """c10::hash_combine on 64 bits (how torch's writer combines its records' crc32s)."""
    return (seed ^ ((value + 0x9E3779B9 + (seed << 6) + (seed >> 2)) & 0xFFFFFFFFFFFFFFFF)) & 0xFFFFFFFFFFFFFFFF


class _Zip:
    """The zip layout of torch's archive writer (miniz, as ``PyTorchStreamWriter`` drives it): each record
    stored, its data on a 64-byte boundary (an ``FB`` extra field of ``Z`` padding in its local header),
    sizes and crc32 in a data descriptor after the data, a central directory and zip64 end records."""

    @staticmethod
    def local_header(name: bytes, at: int) -> bytes:
        pad = -(at + 30 + len(name) + 4) % _ALIGN
        return (struct.pack("<IHHHHHIIIHH", 0x04034B50, 0, 0x0808, 0, 0, 0, 0, 0, 0, len(name), pad + 4) + name
                + b"FB" + struct.pack("<H", pad) + b"Z" * pad)

    @staticmethod
    def descriptor(crc: int, size: int) -> bytes:
        return struct.pack("<IIII", 0x08074B50, crc, size, size)

    @staticmethod
    def entry(name: bytes, crc: int, size: int, at: int) -> bytes:
        """The central directory's entry of the record ``name`` whose local header is at ``at``."""
        return struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 0, 0, 0x0808, 0, 0, 0, crc, size, size, len(name),
                           0, 0, 0, 0, 0, at) + name

    @staticmethod
    def end(records: int, size: int, at: int) -> bytes:
        """The end records after a central directory of ``records`` entries, ``size`` bytes written at ``at``."""
        return (struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 0x031E, 0x002D, 0, 0, records, records, size, at)
                + struct.pack("<IIQI", 0x07064B50, 0, at + size, 1)
                + struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, records, records, size, at, 0))


class _Layout:
    """The archive of one (dtype, shape) but for what depends on the payload's crc32: every byte before
    the payload (``head``) and the pieces of every byte after it (:meth:`tail`)."""

    __slots__ = ("head", "nbytes", "combined", "name_hash", "crcs_after", "middle", "sid_name", "sid_at",
                 "payload_name", "payload_header_at", "entries_before", "entries_after", "end")

    def __init__(self, maker: ArchiveMaker, shape: tuple[int, ...], nbytes: int):
        prefix = maker.prefix

        def records(items: list[tuple[bytes, bytes]], at: int) -> tuple[list[bytes], list[bytes], list[int], int]:
            out, entries, crcs = [], [], []
            for name, data in items:
                header = _Zip.local_header(prefix + name, at)
                crc = zlib.crc32(data)
                out += [header, data, _Zip.descriptor(crc, len(data))]
                entries.append(_Zip.entry(prefix + name, crc, len(data), at))
                crcs.append(crc)
                at += len(header) + len(data) + 16
            return out, entries, crcs, at

        head, entries, crcs, at = records([(b"data.pkl", tensor_pickle(maker.storage_type, shape))] + maker.before, 0)
        self.combined = 0
        for crc in crcs:
            self.combined = _hash_combine(self.combined, crc)
        self.payload_name, self.payload_header_at = prefix + b"data/0", at
        self.head = b"".join(head) + _Zip.local_header(self.payload_name, at)
        self.nbytes, self.name_hash, self.entries_before = nbytes, maker.name_hash, b"".join(entries)
        middle, entries, self.crcs_after, at = records(maker.after, len(self.head) + nbytes + 16)
        self.sid_name, self.sid_at = prefix + b".data/serialization_id", at
        sid_header = _Zip.local_header(self.sid_name, at)
        self.middle = b"".join(middle) + sid_header  # the records after the payload, to the serialization id's data
        self.entries_after = b"".join(entries)
        self.end = (at + len(sid_header) + len(maker.name_hash) + 20 + 16, len(maker.before) + len(maker.after) + 3)

    def tail(self, crc: int) -> bytes:
        """Every byte after a payload whose crc32 is ``crc`` (torch's serialization id combines every
        record's crc32 before it, the payload's included)."""
        combined = _hash_combine(self.combined, crc)
        for value in self.crcs_after:
            combined = _hash_combine(combined, value)
        sid = self.name_hash + b"%020d" % combined
        sid_crc = zlib.crc32(sid)
        directory = (self.entries_before + _Zip.entry(self.payload_name, crc, self.nbytes, self.payload_header_at)
                     + self.entries_after + _Zip.entry(self.sid_name, sid_crc, len(sid), self.sid_at))
        at, count = self.end
        return b"".join((_Zip.descriptor(crc, self.nbytes), self.middle, sid, _Zip.descriptor(sid_crc, len(sid)),
                         directory, _Zip.end(count, len(directory), at)))


class ArchiveMaker:
    """``torch.save`` archives of plain CPU tensors of one dtype, built here byte for byte as the installed
    torch writes them: the records around the payload come from ``torch.save`` of a probe tensor, the
    pickle and zip layout from :func:`tensor_pickle` and :class:`_Zip`, and :func:`archive_maker` makes
    one only after its archives of several probes (0 to 4 dimensions, each pickle integer width)
    equal ``torch.save``'s; a torch that writes otherwise gets none, and its tensors go through
    ``torch.save`` itself."""

    PROBES: tuple[tuple[int, ...], ...] = ((), (3,), (2, 3), (2, 1, 3, 1), (300,), (70000,))  # non-empty: miniz
    # writes an empty record without a data descriptor, and an empty tensor goes through torch.save
    LAYOUTS = 1 << 16  # the shapes whose layouts are kept

    def __init__(self, dtype: torch.dtype, sample: bytes):
        import zipfile

        with zipfile.ZipFile(io.BytesIO(sample)) as archive:
            infos = archive.infolist()
            names = [i.filename.encode() for i in infos]
            records = {i.filename.encode(): archive.read(i) for i in infos}
        self.prefix = names[0][:names[0].index(b"/") + 1]
        names = [n[len(self.prefix):] for n in names]
        if names[0] != b"data.pkl" or b"data/0" not in names or names[-1] != b".data/serialization_id":
            raise ValueError(f"torch.save writes the records {names}")
        cut = names.index(b"data/0")
        self.before = [(n, records[self.prefix + n]) for n in names[1:cut]]
        self.after = [(n, records[self.prefix + n]) for n in names[cut + 1:-1]]
        self.name_hash = records[self.prefix + names[-1]][:20]
        found = re.search(rb"ctorch\n(\w+)\n", records[self.prefix + b"data.pkl"])
        if found is None:
            raise ValueError("no storage type in torch.save's pickle")
        self.storage_type = found.group(1)
        self.dtype = dtype
        self._layouts: dict[tuple[int, ...], _Layout] = {}

    def layout(self, shape: tuple[int, ...], nbytes: int) -> _Layout:
        found = self._layouts.get(shape)
        if found is None:
            if len(self._layouts) >= self.LAYOUTS:
                self._layouts.clear()
            found = self._layouts[shape] = _Layout(self, shape, nbytes)
        return found

    def archive(self, tensor: torch.Tensor) -> bytes:
        """The whole archive of ``tensor`` (plain, contiguous, on the CPU), in one piece (the probes)."""
        view = _buffer(raw_bytes(tensor))
        layout = self.layout(tuple(tensor.shape), len(view))
        return layout.head + bytes(view) + layout.tail(zlib.crc32(view))


_makers: dict[torch.dtype, ArchiveMaker | None] = {}
_makers_lock = threading.Lock()


def archive_maker(dtype: torch.dtype) -> ArchiveMaker | None:
    """The :class:`ArchiveMaker` of ``dtype``, once its archives of every probe equal ``torch.save``'s;
    None where they do not (or a probe cannot be made)."""
    try:
        return _makers[dtype]
    except KeyError:
        pass
    with _makers_lock:
        if dtype not in _makers:
            maker: ArchiveMaker | None = None
            try:
                candidate = None
                for shape in ArchiveMaker.PROBES:
                    probe = torch.zeros(shape, dtype=dtype)
                    saved = io.BytesIO()
                    torch.save(probe, saved)
                    candidate = candidate or ArchiveMaker(dtype, saved.getvalue())
                    if candidate.archive(probe) != saved.getvalue():
                        break
                else:
                    maker = candidate
            except Exception:  # noqa: BLE001 - a dtype torch.save handles otherwise: torch.save it is
                maker = None
            _makers[dtype] = maker
        return _makers[dtype]


PENDING_BYTES = 1 << 20  # the small pieces of a file (archive records, small payloads) go to the store in writes of about this
DIRECT_BYTES = 64 << 10  # a payload of at least this goes to the store from the tensor's own memory, in chunks of its own
SMALL_CHUNK_BYTES = 64 << 10  # the small pieces between two such payloads are digested in chunks of this (a rank that
# needs one small item, a replicated one in another rank's file, reads at most this around it)


class DataFile:
    """One data file of format 3 on its way to ``writer`` (a ``Store`` stream writer): items appended in
    DCP's ``FileSystemWriter`` layout, the chunk digests and payload offsets taken on the way.

    A tensor's archive is what ``torch.save`` writes, byte for byte: built here (:func:`archive_maker`)
    for a plain tensor, else written by ``torch.save`` itself through :meth:`write` (its payload
    recognised by address). A payload of at least ``DIRECT_BYTES`` is handed to the store from the
    tensor's memory as it is (no copy), in chunks of its own of at most ``CHUNK_BYTES`` starting at the
    payload; the smaller pieces between two such payloads (archive records, small payloads, bytes items)
    are gathered into writes of about ``PENDING_BYTES`` and digested in chunks of ``SMALL_CHUNK_BYTES``
    (not one or three a tensor: 16,384 tensors made 49,000 chunks). The zip's crc32 of each record is
    computed as torch does, so that every zip tool, not only torch, accepts the archives."""

    def __init__(self, writer: Any):
        import xxhash

        self.writer = writer
        self.pos = 0  # bytes of the file so far, the pending ones included
        self.chunks: list[list[Any]] = []
        self.payloads: list[list[int]] = []  # [item offset, payload offset] of each non-empty tensor
        self._written = 0  # bytes handed to the writer
        self._start = 0  # where the chunk being digested began
        self._hasher = xxhash.xxh3_128()
        self._pending = bytearray()
        self._payload: list[int] | None = None  # torch.save's payload: [address, nbytes, bytes seen, offset]

    def _cut(self) -> None:
        if self._written > self._start:
            self.chunks.append([self._start, self._written - self._start, self._hasher.hexdigest()])
            self._hasher.reset()
        self._start = self._written

    def _stream(self, data: Any, limit: int) -> None:
        view = memoryview(data)
        n, at = len(view), 0
        while at < n:
            take = min(n - at, limit - (self._written - self._start))
            piece = view[at:at + take]
            self._hasher.update(piece)
            self.writer.write(piece)
            self._written += take
            at += take
            if self._written - self._start >= limit:
                self._cut()

    def _flush(self) -> None:
        if self._pending:
            pending, self._pending = self._pending, bytearray()
            self._stream(pending, min(SMALL_CHUNK_BYTES, verify.CHUNK_BYTES))

    def _emit(self, data: Any) -> None:
        n = len(data)
        if n < DIRECT_BYTES:
            self._pending += data
            if len(self._pending) >= PENDING_BYTES:
                self._flush()
        else:  # a large payload: chunks of its own, as a reader of a part of it needs
            self._flush()
            self._cut()
            self._stream(data, verify.CHUNK_BYTES)
            self._cut()
        self.pos += n

    def write(self, data: Any) -> int:
        """The file-object side ``torch.save`` writes to."""
        view = memoryview(data).cast("B")
        n = len(view)
        p = self._payload
        if p is not None and n and p[2] < p[1] and _address(view) == p[0] + p[2]:
            if p[2] == 0:
                p[3] = self.pos
            p[2] += n
        self._emit(view)
        return n

    def flush(self) -> None:
        pass

    def add_bytes(self, buffer: Any) -> None:
        """A bytes item, as DCP serialised it."""
        self._emit(memoryview(buffer).cast("B"))

    def add_tensor(self, tensor: torch.Tensor) -> None:
        """A tensor item: the archive ``torch.save`` writes of a plain contiguous tensor whose storage is
        exactly its bytes."""
        offset = self.pos
        if tensor.is_conj() or tensor.is_neg() or not tensor.is_contiguous():
            tensor = tensor.resolve_conj().resolve_neg().contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        maker = archive_maker(tensor.dtype) if 0 < nbytes < ARCHIVE_MAX_BYTES else None
        if maker is not None and tensor.layout == torch.strided:
            view = tensor_bytes(tensor)
            layout = maker.layout(tuple(tensor.shape), nbytes)
            self._emit(layout.head)
            self.payloads.append([offset, self.pos])
            self._emit(view)
            self._emit(layout.tail(zlib.crc32(view)))
            return
        self._torch_save(tensor, offset, nbytes)

    def _torch_save(self, tensor: torch.Tensor, offset: int, nbytes: int) -> None:
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
        """Write what is pending, digest the last chunk and close the writer (the file is complete in the store)."""
        self._flush()
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
