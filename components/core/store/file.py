"""The filesystem backend: a local or shared POSIX directory, ``/path`` or ``file:///path``.

Every write is atomic (temp file, fsync, rename, fsync of the directory): readers see the old or the
new file. Files written here get the mode the process umask gives a new file (``0o666 & ~umask``:
0644 under umask 022), as data files written by DCP do, so a reader under another uid on shared
storage can open every file of a checkpoint.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import os
import secrets
import shutil
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any, Callable, Iterable

from . import (READ_BLOCK, PreconditionFailed, Segments, StreamWriter, check_key, join_uri,
               register_backend)

# A temp file of an atomic write untouched this long belongs to a writer that died
# (``FileStore.abort_incomplete_uploads``); a live write touches its file within milliseconds.
TMP_GRACE_S = 600.0


def _new_tmp(target: Path) -> tuple[int, Path]:
    """A new, empty temp file beside ``target`` (``.<name>.<random>.tmp``), open for writing.
    Created with mode 0o666 so that the kernel applies the umask (and a directory's default ACL),
    as for any other file; ``tempfile.mkstemp`` would force 0600."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    while True:
        tmp = target.with_name(f".{target.name}.{secrets.token_hex(6)}.tmp")
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:  # pragma: no cover - 48 random bits
            continue


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@register_backend
class FileStore:
    """A local or shared POSIX directory. Every write is atomic: readers see the old or the new file."""

    scheme = "file"
    example = "file:///path"

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root).absolute()
        self.uri = str(self.root)
        self.stats: collections.Counter = collections.Counter()
        self._stats_lock = threading.Lock()

    @classmethod
    def parse(cls, uri: str) -> tuple[str, str]:
        """``(path, "")`` of a plain path or of ``file:///path``.

        Raises:
            ValueError: a ``file://`` URI with a host or without a path.
        """
        if "://" not in uri:
            return uri, ""
        parsed = urllib.parse.urlparse(uri)
        if parsed.netloc not in ("", "localhost") or not parsed.path:
            raise ValueError(f"file URI {uri!r} must be file:///absolute/path")
        return urllib.parse.unquote(parsed.path), ""

    @classmethod
    def open(cls, location: str, prefix: str = "", **options: Any) -> "FileStore":
        """The directory ``location`` (created by the first write); no option applies."""
        return cls(location)

    def path(self, key: str) -> Path:
        """The local path of ``key`` (DCP writes and reads there directly)."""
        return self.root / check_key(key) if key else self.root

    def _count(self, op: str, nbytes: str = "", n: int = 0) -> None:
        with self._stats_lock:
            self.stats[op] += 1
            self.stats["requests"] += 1
            if nbytes:
                self.stats[nbytes] += n

    def read_bytes(self, key: str) -> bytes:
        """The content of ``key``; FileNotFoundError if absent."""
        data = self.path(key).read_bytes()
        self._count("read", "bytes_read", len(data))
        return data

    def read_into(self, key: str, offset: int, buffer: Any, *, sink: Callable[[int], None] | None = None) -> None:
        """Fill ``buffer`` (a writable buffer, or a list of them filled one after another) with the
        bytes of ``key`` from ``offset`` on, one pass front to back in blocks of READ_BLOCK; after
        each block ``sink(bytes filled so far)`` (a check of what arrived, while it is in cache).

        Raises:
            FileNotFoundError: no such key.
            EOFError: the key ends before the buffers are full.
        """
        segments = Segments(buffer)
        total = segments.total
        with open(self.path(key), "rb", buffering=0) as fh:
            fd = fh.fileno()
            if total > READ_BLOCK and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, offset, total, os.POSIX_FADV_SEQUENTIAL)
            done = 0
            while done < total:
                n = os.preadv(fd, segments.slices(done, min(READ_BLOCK, total - done)), offset + done)
                if not n:
                    raise EOFError(f"{self.uri_for(key)} ends at byte {offset + done}, "
                                   f"{total - done} bytes before the range asked for")
                done += n
                if sink is not None:
                    sink(done)
        self._count("read_range", "bytes_read", done)

    def open_writer(self, key: str) -> StreamWriter:
        """Write ``key`` in place, front to back; ``close()`` makes it durable (fsync)."""
        self._count("open_writer")
        return _FileWriter(self, self.path(key))

    def sizes(self, prefix: str) -> dict[str, int]:
        """``{key: size}`` of the files directly under the directory ``prefix`` (one listing)."""
        self._count("sizes")
        base = self.path(prefix.rstrip("/"))
        out: dict[str, int] = {}
        try:
            with os.scandir(base) as it:
                for entry in it:
                    if entry.is_file() and not _is_tmp(entry.name):
                        out[f"{prefix.rstrip('/')}/{entry.name}"] = entry.stat().st_size
        except (FileNotFoundError, NotADirectoryError):
            pass
        return out

    def _atomic_write(self, target: Path, writer: Callable[[Any], None]) -> None:
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd, tmp = _new_tmp(target)
        except OSError:
            self._prune(target.parent)  # a full store: no empty folders left behind either
            raise
        try:
            with os.fdopen(fd, "wb") as fh:
                writer(fh)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            self._prune(target.parent)
            raise
        _fsync_dir(target.parent)

    def write_bytes(self, key: str, data: bytes, *, if_match: str | None = None) -> str:
        """Atomically replace ``key``; with ``if_match`` only if its current etag is that one.
        Returns the new etag. (The check and the rename are not one atomic step on POSIX: the lease
        is what keeps a second writer out; this catches the slow, common races.)"""
        self._count("write")
        target = self.path(key)
        if if_match is not None and _file_etag(target) != if_match:
            raise PreconditionFailed(f"{self.uri_for(key)} changed since it was read (another writer?)")
        self._atomic_write(target, lambda fh: fh.write(data))
        return hashlib.sha256(data).hexdigest()

    def write_if_absent(self, key: str, data: bytes) -> bool:
        """Create ``key`` only if it does not exist (atomic: link(2) of a complete temp file)."""
        self._count("write_if_absent")
        target = self.path(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = _new_tmp(target)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            try:
                os.link(tmp, target)
            except FileExistsError:
                # NFS: a retransmitted LINK whose first reply was lost answers EEXIST although it
                # was ours; then the temp file has a second name, and it is the target
                if os.stat(tmp).st_nlink > 1 and os.path.samefile(tmp, target):
                    _fsync_dir(target.parent)
                    return True
                return False
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        _fsync_dir(target.parent)
        return True

    def upload_file(self, key: str, path: str | os.PathLike) -> None:
        """Copy a local file to ``key`` atomically."""
        self._count("upload")
        with open(path, "rb") as src:
            self._atomic_write(self.path(key), lambda fh: shutil.copyfileobj(src, fh, 8 * 1024 * 1024))

    def download_file(self, key: str, path: str | os.PathLike) -> None:
        """Copy ``key`` to a local file; FileNotFoundError if absent."""
        self._count("download")
        shutil.copyfile(self.path(key), path)

    def exists(self, key: str) -> bool:
        self._count("exists")
        return self.path(key).exists()

    def etag(self, key: str) -> str | None:
        """A version token of ``key`` (the sha256 of its content) or None if absent."""
        self._count("etag")
        return _file_etag(self.path(key))

    def list(self, prefix: str = "", recursive: bool = True) -> list[str]:
        """Keys under ``prefix`` (a directory prefix), sorted; non-recursive lists sub-directories
        once, with a trailing ``/``. Temp files of interrupted atomic writes are not listed."""
        self._count("list")
        base = self.path(prefix.rstrip("/")) if prefix else self.root
        if not base.is_dir():
            return []
        rel = lambda p: p.relative_to(self.root).as_posix()  # noqa: E731
        out: list[str] = []
        if recursive:
            for dirpath, _dirs, files in os.walk(base):
                out += [rel(Path(dirpath) / f) for f in files if not _is_tmp(f)]
        else:
            with os.scandir(base) as it:
                for entry in it:
                    if entry.is_dir():
                        out.append(rel(Path(entry.path)) + "/")
                    elif not _is_tmp(entry.name):
                        out.append(rel(Path(entry.path)))
        return sorted(out)

    def delete(self, key: str) -> None:
        """Remove ``key`` (no error if absent) and prune the directories it leaves empty."""
        self._count("delete")
        target = self.path(key)
        with contextlib.suppress(FileNotFoundError):
            target.unlink()
        self._prune(target.parent)

    def _prune(self, parent: Path) -> None:
        """Remove ``parent`` and its ancestors below the root while they are empty."""
        while parent != self.root and parent.is_dir():
            try:
                parent.rmdir()
            except OSError:
                break
            parent = parent.parent

    def delete_many(self, keys: Iterable[str]) -> None:
        for key in keys:
            self.delete(key)

    def abort_incomplete_uploads(self, prefix: str) -> int:
        """Remove what writers killed in an atomic write left under the directory ``prefix``: temp
        files (``.<name>.<random>.tmp``) not modified for TMP_GRACE_S seconds. Returns how many.

        A filesystem has no multipart uploads; these temp files are its equivalent (never listed,
        never read, only taking space). A streamed file (``open_writer``) is written in place and
        is not touched here: it lies in an uncommitted checkpoint directory, which the checkpoint
        code removes. Call it while holding the write lease."""
        self._count("abort_incomplete_uploads")
        base = self.path(prefix.rstrip("/")) if prefix else self.root
        cutoff = time.time() - TMP_GRACE_S
        removed = 0
        for dirpath, _dirs, files in os.walk(base):
            for name in files:
                if not _is_tmp(name):
                    continue
                path = Path(dirpath) / name
                try:
                    if path.stat().st_mtime <= cutoff:
                        path.unlink()
                        removed += 1
                except FileNotFoundError:  # its writer finished (or another cleaner) meanwhile
                    continue
        return removed

    def uri_for(self, key: str) -> str:
        return join_uri(self.uri, key)

    def free_bytes(self, key: str = "") -> int | None:
        """The bytes this process may still write where ``key`` lies (``statvfs`` of its nearest existing
        folder: ``f_bavail``), or None where that cannot be read. A writer asks when a write failed
        without saying why (a library that wraps the ``OSError`` of a full disk loses its errno)."""
        path = self.path(key)
        while not path.exists() and path != path.parent:
            path = path.parent
        try:
            stat = os.statvfs(path)
        except OSError:
            return None
        return stat.f_bavail * stat.f_frsize


class _FileWriter:
    def __init__(self, store: FileStore, path: Path):
        self.store, self.path = store, path
        path.parent.mkdir(parents=True, exist_ok=True)
        self.fh = open(path, "wb")

    def write(self, data: Any) -> None:
        n = self.fh.write(data)
        with self.store._stats_lock:
            self.store.stats["bytes_written"] += n

    def close(self) -> None:
        if self.fh.closed:
            return
        self.fh.flush()
        os.fsync(self.fh.fileno())
        self.fh.close()
        _fsync_dir(self.path.parent)

    def abort(self) -> None:
        # a full store fails the buffered writer's last flush again: the file is removed all the same
        # (its space is what the next save needs), and the write's own error is the one that counts
        with contextlib.suppress(OSError):
            self.fh.close()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        self.store._prune(self.path.parent)


def _is_tmp(name: str) -> bool:
    return name.startswith(".") and name.endswith(".tmp")


def _file_etag(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except FileNotFoundError:
        return None

