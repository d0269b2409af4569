"""Reading format-1 checkpoints (written by relaunch before format 2): DCP's own file layout
(``torch.save`` archives per item) with a sha256 of every file in the manifest.

A v1 checkpoint is verified whole (every file's size and sha256) and then read through DCP's
filesystem reader (``.metadata`` through the restricted unpickler, dense tensors straight into
their destination). On S3 the files are first downloaded into the manager's cache directory: v1
has no per-chunk digests, so there is nothing to check a ranged read against.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import io
import os
import struct
import sys
import zipfile
from pathlib import Path, PurePosixPath
from typing import Any

import torch

from .layout import step_key
from ..contract.errors import CorruptCheckpoint
from ..store import FileStore, Store

_HASH_CHUNK = 8 * 1024 * 1024
_IO_THREADS = max(1, min(4, os.cpu_count() or 1))
DIRECT_MIN_BYTES = 256 * 1024  # stored tensors from this size on are read straight into place


def _advise(fd: int, offset: int, length: int, advice: str) -> None:
    fn = getattr(os, "posix_fadvise", None)
    if fn is not None:
        try:
            fn(fd, offset, length, getattr(os, advice))
        except OSError:
            pass  # only a hint (some filesystems refuse it)


def sha256_file(path: Path) -> tuple[int, str]:
    h = hashlib.sha256()
    size = 0
    buf = bytearray(_HASH_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as fh:
        _advise(fh.fileno(), 0, 0, "POSIX_FADV_SEQUENTIAL")
        while True:
            n = fh.readinto(buf)
            if not n:
                break
            h.update(view[:n])
            size += n
    return size, h.hexdigest()


def materialize(store: Store, step: int, manifest: dict[str, Any], cache: Path) -> Path:
    """A local directory holding the verified files of v1 checkpoint ``step`` (the store itself on
    a filesystem, a download on S3); every file's size and sha256 are checked."""
    key = step_key(step)
    files: dict[str, dict[str, Any]] = manifest["files"]
    if type(store) is FileStore:
        local = store.path(key)
        paths = {name: local / name for name in files}
    else:
        local = cache / f"load-{step:012d}-{manifest['_sha256'][:16]}"
        local.mkdir(parents=True, exist_ok=True)
        paths = {}
        for name in files:
            try:
                store.download_file(f"{key}/{name}", local / name)
            except FileNotFoundError:
                raise CorruptCheckpoint(f"{store.uri_for(key)}/{name} is missing") from None
            paths[name] = local / name
    for name, path in paths.items():
        if not path.is_file():
            raise CorruptCheckpoint(f"{store.uri_for(key)}/{name} is missing")
        size = path.stat().st_size
        if size != files[name].get("size"):
            raise CorruptCheckpoint(f"{store.uri_for(key)}/{name} has {size} bytes, the manifest says "
                                    f"{files[name].get('size')} (truncated?)")
    with concurrent.futures.ThreadPoolExecutor(max(1, min(_IO_THREADS, len(paths)))) as pool:
        digests = dict(zip(paths, pool.map(lambda p: sha256_file(p)[1], paths.values())))
    for name, meta in files.items():
        if digests[name] != meta.get("sha256"):
            raise CorruptCheckpoint(f"{store.uri_for(key)}/{name} does not match its sha256 in the manifest")
    return local


class FileWindow(io.RawIOBase):
    """``length`` bytes of the open binary file ``stream`` from ``offset`` on, read as a file of their
    own (a ``torch.save`` archive inside a DCP data file, for ``torch.load`` and ``zipfile``)."""

    def __init__(self, stream: Any, offset: int, length: int):
        super().__init__()
        self.stream, self.offset, self.length, self.pos = stream, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self.pos, os.SEEK_END: self.length}[whence]
        self.pos = max(0, base + pos)
        return self.pos

    def readinto(self, buffer: Any) -> int:
        n = max(0, min(len(buffer), self.length - self.pos))
        if not n:
            return 0
        self.stream.seek(self.offset + self.pos)
        got = self.stream.readinto(memoryview(buffer).cast("B")[:n])
        self.pos += got
        return got


_LOCAL_HEADER = struct.Struct("<4s22xHH")  # a zip local file header: signature, ..., name and extra lengths


def archive_payload(archive: Any) -> tuple[int, int] | None:
    """(offset, size) within the ``torch.save`` archive ``archive`` (a seekable binary file) of the bytes
    of its one tensor storage, stored uncompressed in this machine's byte order; None for any other
    archive (several storages, compressed, another byte order, not a zip)."""
    try:
        with zipfile.ZipFile(archive) as zf:
            records = zf.infolist()
            storages = [r for r in records if PurePosixPath(r.filename).parent.name == "data"]
            order = [r for r in records if PurePosixPath(r.filename).name == "byteorder"]
            if order and zf.read(order[0]) != sys.byteorder.encode():
                return None
    except (zipfile.BadZipFile, OSError, EOFError):
        return None
    if len(storages) != 1 or storages[0].compress_type != zipfile.ZIP_STORED:
        return None
    record = storages[0]
    archive.seek(record.header_offset)
    header = archive.read(_LOCAL_HEADER.size)
    if len(header) != _LOCAL_HEADER.size:
        return None
    signature, name_bytes, extra_bytes = _LOCAL_HEADER.unpack(header)
    if signature != b"PK\x03\x04":
        return None
    return record.header_offset + _LOCAL_HEADER.size + name_bytes + extra_bytes, record.file_size


def read_metadata(path: str | os.PathLike):
    """DCP metadata of a local checkpoint directory, read safely."""
    from .safe_pickle import load_metadata

    with open(Path(path) / ".metadata", "rb") as fh:
        return load_metadata(fh, source=str(Path(path) / ".metadata"))


def safe_reader(path: str | os.PathLike):
    """DCP's filesystem reader with ``.metadata`` read through the restricted unpickler, and plain
    tensors read straight from the file into their destination (one copy, not three)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta
    from torch.distributed.checkpoint.planner import LoadItemType

    from .safe_pickle import load_metadata

    class SafeFileSystemReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any):
            rank = kwargs.get("rank")  # DCP's name for a rank's own metadata file
            path = self.fs.concat_path(self.path, ".metadata" if rank is None else f"__{rank}.metadata")
            with self.fs.create_stream(path, "rb") as fh:
                metadata = load_metadata(fh, source=str(path))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

        def read_data(self, plan, planner):
            other = []
            per_file: dict[str, list[Any]] = {}
            for req in plan.items:
                md = self.storage_data[req.storage_index]
                if req.type == LoadItemType.BYTE_IO or md.transform_descriptors:
                    other.append(req)
                else:
                    per_file.setdefault(md.relative_path, []).append(req)
            for relative_path, reqs in per_file.items():
                with open(self.fs.concat_path(self.path, relative_path), "rb") as stream:
                    _advise(stream.fileno(), 0, 0, "POSIX_FADV_SEQUENTIAL")
                    for req in sorted(reqs, key=lambda r: self.storage_data[r.storage_index].offset):
                        if not self._read_direct(stream, req, planner):
                            other.append(req)
            if other:
                return super().read_data(dataclasses.replace(plan, items=other), planner)
            fut: torch.futures.Future = torch.futures.Future()
            fut.set_result(None)
            return fut

        def _read_direct(self, stream, req, planner) -> bool:
            md = self.storage_data[req.storage_index]
            if md.length < DIRECT_MIN_BYTES:  # parsing the header twice costs more than the copy saves
                return False
            meta = torch.load(FileWindow(stream, md.offset, md.length), map_location="meta", weights_only=True)
            payload = archive_payload(FileWindow(stream, md.offset, md.length))
            nbytes = meta.numel() * meta.element_size()
            if (payload is None or payload[1] != nbytes or not meta.is_contiguous()
                    or meta.storage_offset() != 0 or meta.untyped_storage().nbytes() != nbytes
                    or any(req.storage_offsets) or list(req.lengths) != list(meta.shape)
                    or payload[0] + nbytes > md.length):
                return False
            start = payload[0]
            target = planner.resolve_tensor(req).detach()
            if (target.device.type != "cpu" or target.dtype != meta.dtype or target.shape != meta.shape
                    or not target.is_contiguous()):
                return False
            if nbytes:
                view = memoryview(target.reshape(-1).view(torch.uint8).numpy())
                stream.seek(md.offset + start)
                done = 0
                while done < nbytes:
                    n = stream.readinto(view[done:])
                    if not n:
                        raise CorruptCheckpoint(f"{Path(self.path) / md.relative_path} ends inside "
                                                f"{req.storage_index.fqn!r}")
                    done += n
            planner.commit_tensor(req, target)
            return True

    return SafeFileSystemReader(path)


__all__ = ["DIRECT_MIN_BYTES", "materialize", "read_metadata", "safe_reader", "sha256_file"]
