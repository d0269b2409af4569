"""One small storage interface, two backends chosen by URI.

    store = open_store("/shared/exp")              # or file:///shared/exp
    store = open_store("s3://bucket/exp/run")      # endpoint and credentials from the environment

Keys are ``/``-separated and relative to the store root. The filesystem backend writes atomically
(temp file, fsync, rename, fsync of the directory); the S3 backend talks to any S3-compatible server
through the ``minio`` client, uploads large files in parallel multipart parts and retries transient
failures (connection reset, timeout, 5xx, SlowDown) with exponential backoff and full jitter, a
bounded number of times, before raising :class:`TransientFailure` (exit 138). Permanent failures
(403, NoSuchBucket, bad credentials, malformed URI) raise :class:`BadInput` (exit 2) at once.

S3 configuration, from the environment only (never from arguments that end up in logs):
``AWS_ENDPOINT_URL`` (``http(s)://host:port``; TLS from the scheme), ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_REGION``/``AWS_DEFAULT_REGION``; or the MinIO
equivalents ``MINIO_ENDPOINT`` (``host:port`` or a URL), ``MINIO_ACCESS_KEY``, ``MINIO_SECRET_KEY``,
``MINIO_SECURE`` (``true``/``false``), ``MINIO_REGION``. Retry tuning: ``RELAUNCH_STORE_RETRIES``
(attempts, default 8) and ``RELAUNCH_STORE_BACKOFF`` (first backoff in seconds, default 0.1).

Files written through :class:`FileStore` get the mode the process umask gives a new file
(``0o666 & ~umask``: 0644 under umask 022), as data files written by DCP do, so a reader under
another uid on shared storage can open every file of a checkpoint.

The minio and urllib3 private calls this module needs (conditional PUTs, per-part retried
multipart uploads, ListMultipartUploads, reads from the socket into our buffers) all go through
:class:`_MinioCalls` at the end of this file, whose recorded signatures a test checks.
"""

from __future__ import annotations

import bisect
import collections
import concurrent.futures
import contextlib
import hashlib
import os
import random
import secrets
import shutil
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any, Callable, Iterable, Protocol, TypeVar, runtime_checkable

from components.core.errors import BadInput, TransientFailure

T = TypeVar("T")

MULTIPART_THRESHOLD = 64 * 1024 * 1024
# A ranged read fills its buffers in blocks of this size and reports each (``sink``): small enough
# that a check of the block (a digest) finds it still in the CPU's cache, which made the digest
# almost free here (measured: 512 KiB blocks read+digest ~ a plain read; 1 MiB and up ~ +40%).
READ_BLOCK = 512 * 1024
PART_SIZE = 32 * 1024 * 1024
PARALLEL_PARTS = 4
# A temp file of an atomic write untouched this long belongs to a writer that died
# (``FileStore.abort_incomplete_uploads``); a live write touches its file within milliseconds.
TMP_GRACE_S = 600.0


class PreconditionFailed(BadInput):
    """A conditional write lost: the key existed, or changed since it was read (a second writer)."""


@runtime_checkable
class Store(Protocol):
    """What the checkpoint code needs from a storage backend; keys are relative to ``uri``."""

    uri: str
    stats: collections.Counter

    def read_bytes(self, key: str) -> bytes: ...
    def write_bytes(self, key: str, data: bytes, *, if_match: str | None = None) -> str | None: ...
    def write_if_absent(self, key: str, data: bytes) -> bool: ...
    def upload_file(self, key: str, path: str | os.PathLike) -> None: ...
    def download_file(self, key: str, path: str | os.PathLike) -> None: ...
    def read_into(self, key: str, offset: int, buffer: Any, *, sink: Callable[[int], None] | None = None) -> None: ...
    def open_writer(self, key: str) -> "StreamWriter": ...
    def sizes(self, prefix: str) -> dict[str, int]: ...
    def exists(self, key: str) -> bool: ...
    def etag(self, key: str) -> str | None: ...
    def list(self, prefix: str = "", recursive: bool = True) -> list[str]: ...
    def delete(self, key: str) -> None: ...
    def delete_many(self, keys: Iterable[str]) -> None: ...
    def abort_incomplete_uploads(self, prefix: str) -> int: ...
    def uri_for(self, key: str) -> str: ...


class StreamWriter(Protocol):
    """A key being written front to back (``Store.open_writer``): nothing is visible under the key
    before ``close()`` returns on S3; on a filesystem the file is written in place (callers write
    only into uncommitted checkpoint directories). ``abort()`` drops what was written."""

    def write(self, data: Any) -> None: ...
    def close(self) -> None: ...
    def abort(self) -> None: ...


def _byte_view(buffer: Any) -> memoryview:
    view = memoryview(buffer)
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


class _Segments:
    """Writable buffers filled one after another as if they were one (a vectored read's target)."""

    def __init__(self, buffer: Any):
        parts = buffer if isinstance(buffer, (list, tuple)) else [buffer]
        self.views = [v for v in (_byte_view(b) for b in parts) if len(v)]
        self.starts = []
        total = 0
        for v in self.views:
            self.starts.append(total)
            total += len(v)
        self.total = total

    def slices(self, pos: int, n: int) -> list[memoryview]:
        """The views covering bytes ``[pos, pos + n)``."""
        out, end = [], pos + n
        i = max(0, bisect.bisect_right(self.starts, pos) - 1)
        while pos < end and i < len(self.views):
            start, view = self.starts[i], self.views[i]
            lo, hi = pos - start, min(len(view), end - start)
            if lo < hi:
                out.append(view[lo:hi])
                pos = start + hi
            i += 1
        return out


def _join(root: str, key: str) -> str:
    return f"{root.rstrip('/')}/{key.lstrip('/')}" if key else root


def _check_key(key: str) -> str:
    if key.startswith("/") or any(part in ("..", ".") for part in key.split("/")):
        raise BadInput(f"store key {key!r} must be relative and must not contain '.' or '..' parts")
    return key


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


class FileStore:
    """A local or shared POSIX directory. Every write is atomic: readers see the old or the new file."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root).absolute()
        self.uri = str(self.root)
        self.stats: collections.Counter = collections.Counter()
        self._stats_lock = threading.Lock()

    def path(self, key: str) -> Path:
        """The local path of ``key`` (DCP writes and reads there directly)."""
        return self.root / _check_key(key) if key else self.root

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
        segments = _Segments(buffer)
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
        fd, tmp = _new_tmp(target)
        try:
            with os.fdopen(fd, "wb") as fh:
                writer(fh)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
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
        return _join(self.uri, key)


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


# ---------------------------------------------------------------------------------------------- S3

_TRANSIENT_CODES = {"SlowDown", "InternalError", "ServiceUnavailable", "RequestTimeout", "Throttling",
                    "ThrottlingException", "RequestTimeTooSkewed", "OperationAborted", "ServerError",
                    # 409 to a conditional write that raced another write of the key: AWS asks for a
                    # retry, which then gets 412 if the other one won
                    "ConditionalRequestConflict"}
_CREDENTIAL_CODES = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "InvalidToken",
                     "ExpiredToken", "AllAccessDisabled", "AccountProblem"}


def _env(*names: str) -> str | None:
    for name in names:
        if os.environ.get(name):
            return os.environ[name]
    return None


def _s3_settings() -> dict[str, Any]:
    endpoint = _env("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "MINIO_ENDPOINT")
    if not endpoint:
        raise BadInput("s3:// store needs an endpoint: set AWS_ENDPOINT_URL (or MINIO_ENDPOINT)")
    secure_env = os.environ.get("MINIO_SECURE")
    if "://" in endpoint:
        parsed = urllib.parse.urlparse(endpoint)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise BadInput(f"AWS_ENDPOINT_URL {endpoint!r} is not http(s)://host[:port]")
        secure, host = parsed.scheme == "https", parsed.netloc
    else:
        host = endpoint
        secure = (secure_env or "true").lower() in ("1", "true", "yes", "on")
    access = _env("AWS_ACCESS_KEY_ID", "MINIO_ACCESS_KEY", "MINIO_ROOT_USER")
    secret = _env("AWS_SECRET_ACCESS_KEY", "MINIO_SECRET_KEY", "MINIO_ROOT_PASSWORD")
    if bool(access) != bool(secret):
        raise BadInput("S3 credentials incomplete: set both AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")
    return {"endpoint": host, "secure": secure, "access_key": access, "secret_key": secret,
            "session_token": _env("AWS_SESSION_TOKEN"),
            "region": _env("AWS_REGION", "AWS_DEFAULT_REGION", "MINIO_REGION") or "us-east-1",
            "cert_check": (os.environ.get("RELAUNCH_S3_CERT_CHECK", "true").lower() != "false")}


class S3Store:
    """An S3-compatible bucket/prefix through ``minio``, with bounded retries of transient errors."""

    def __init__(self, bucket: str, prefix: str, *, retries: int | None = None, backoff: float | None = None):
        import urllib3
        from minio import Minio

        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.uri = f"s3://{bucket}/{self.prefix}".rstrip("/")
        self.stats: collections.Counter = collections.Counter()
        self._stats_lock = threading.Lock()
        self.retries = int(retries if retries is not None else os.environ.get("RELAUNCH_STORE_RETRIES", 8))
        self.backoff = float(backoff if backoff is not None else os.environ.get("RELAUNCH_STORE_BACKOFF", 0.1))
        self.max_backoff = 5.0
        s = _s3_settings()
        self.endpoint = s["endpoint"]
        http = urllib3.PoolManager(
            timeout=urllib3.Timeout(connect=10, read=60), maxsize=16, retries=False,
            cert_reqs="CERT_REQUIRED" if s["cert_check"] else "CERT_NONE",
            ca_certs=os.environ.get("SSL_CERT_FILE") or _certifi_where())
        self.client = Minio(s["endpoint"], access_key=s["access_key"], secret_key=s["secret_key"],
                            session_token=s["session_token"], secure=s["secure"], region=s["region"],
                            http_client=http)
        self._minio = _MinioCalls(self.client)

    # -- plumbing
    def _name(self, key: str) -> str:
        _check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _count(self, op: str, n: int = 1) -> None:
        with self._stats_lock:
            self.stats[op] += n
            self.stats["requests"] += n

    def _add_bytes(self, what: str, n: int) -> None:
        with self._stats_lock:
            self.stats[what] += n

    def _call(self, op: str, fn: Callable[[], T], *, key: str = "") -> T:
        """Run one request with bounded retries of transient failures; map permanent ones."""
        from minio.error import S3Error

        delay = self.backoff
        for attempt in range(1, self.retries + 1):
            self._count(op)
            try:
                return fn()
            except S3Error as err:
                if err.code in ("NoSuchKey", "NoSuchUpload") or (err.code == "ResourceNotFound" and key):
                    raise FileNotFoundError(self.uri_for(key)) from None
                if err.code == "InvalidRange":
                    raise EOFError(f"{self.uri_for(key)} is shorter than the range asked for") from None
                if err.code == "NoSuchBucket":
                    raise BadInput(f"bucket {self.bucket!r} does not exist at {self.endpoint}; create it "
                                   f"or fix the store URI") from None
                if err.code in _CREDENTIAL_CODES:
                    raise BadInput(f"S3 refused {op} on {self.uri_for(key)}: {err.code} (check "
                                   f"AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY and the bucket policy)") from None
                if err.code == "PreconditionFailed":
                    raise PreconditionFailed(f"{self.uri_for(key)} exists or changed since it was read "
                                             f"(another writer?)") from None
                status = getattr(err.response, "status", 0) or 0
                if err.code not in _TRANSIENT_CODES and status < 500:
                    raise BadInput(f"S3 error on {op} {self.uri_for(key)}: {err.code}: {err.message}") from None
                last: BaseException = err
            except Exception as err:  # noqa: BLE001 - classified just below
                if not _is_transient(err):
                    raise
                last = err
            if attempt == self.retries:
                break
            sleep = random.uniform(0, delay)  # full jitter
            with self._stats_lock:
                self.stats["retries"] += 1
                self.stats["retry_seconds"] += sleep
            time.sleep(sleep)
            delay = min(delay * 2, self.max_backoff)
        raise TransientFailure(f"S3 {op} {self.uri_for(key)} failed {self.retries} times; last error: "
                               f"{type(last).__name__}: {str(last)[:200]}")

    # -- the interface
    def check(self) -> None:
        """One cheap request that proves endpoint, credentials and bucket."""
        if not self._call("bucket_exists", lambda: self.client.bucket_exists(self.bucket)):
            raise BadInput(f"bucket {self.bucket!r} does not exist at {self.endpoint}; create it or fix the store URI")

    def read_bytes(self, key: str) -> bytes:
        name = self._name(key)

        def get() -> bytes:
            resp = self.client.get_object(self.bucket, name)
            try:
                return resp.read()
            finally:
                resp.close()
                resp.release_conn()

        data = self._call("get", get, key=key)
        self._add_bytes("bytes_read", len(data))
        return data

    def read_into(self, key: str, offset: int, buffer: Any, *, sink: Callable[[int], None] | None = None) -> None:
        """One ranged GET of the bytes that fill ``buffer`` (a writable buffer, or a list of them
        filled one after another) from ``offset``, straight from the socket into the buffers, with
        ``sink(bytes filled so far)`` after each READ_BLOCK (a retried request starts over at
        ``sink(0)``). FileNotFoundError if absent; EOFError if short."""
        segments = _Segments(buffer)
        total = segments.total
        if not total:
            return
        name = self._name(key)

        def get() -> int:
            if sink is not None:
                sink(0)
            resp = self.client.get_object(self.bucket, name, offset=offset, length=total)
            try:
                readinto = _MinioCalls.socket_readinto(resp) or resp.readinto
                done = 0
                while done < total:
                    for piece in segments.slices(done, min(READ_BLOCK, total - done)):
                        filled = 0
                        while filled < len(piece):
                            n = readinto(piece[filled:])
                            if not n:
                                return done + filled
                            filled += n
                        done += filled
                    if sink is not None:
                        sink(done)
                return done
            finally:
                resp.close()
                resp.release_conn()

        done = self._call("get_range", get, key=key)
        if done < total:
            raise EOFError(f"{self.uri_for(key)} ends {total - done} bytes before the range asked for")
        self._add_bytes("bytes_read", done)

    def open_writer(self, key: str) -> StreamWriter:
        """Stream ``key`` up: one PUT when it stays below one part, else a multipart upload whose
        parts go up in parallel while the caller writes on (at most PARALLEL_PARTS in flight)."""
        self._count("open_writer")
        return _MultipartWriter(self, key)

    def sizes(self, prefix: str) -> dict[str, int]:
        """``{key: size}`` of the objects directly under ``prefix`` (one LIST request)."""
        full = self._name(prefix.rstrip("/")) + "/"
        strip = len(self.prefix) + 1 if self.prefix else 0

        def listing() -> dict[str, int]:
            return {o.object_name[strip:]: int(o.size or 0) for o in
                    self.client.list_objects(self.bucket, prefix=full, recursive=False) if not o.is_dir}

        return self._call("list", listing, key=prefix)

    def _conditional_put(self, key: str, data: bytes, headers: dict[str, str]) -> tuple[Any, int]:
        """PUT with conditional headers; returns (result, attempts made)."""
        name, attempts = self._name(key), [0]

        def put() -> Any:
            attempts[0] += 1
            return self._minio.put(self.bucket, name, data, {"Content-Type": "application/octet-stream", **headers})

        try:
            return self._call("put", put, key=key), attempts[0]
        except PreconditionFailed as err:
            err.attempts = attempts[0]  # type: ignore[attr-defined]
            raise

    def _holds(self, key: str, data: bytes) -> bool:
        try:
            return self.read_bytes(key) == data
        except FileNotFoundError:
            return False

    def write_bytes(self, key: str, data: bytes, *, if_match: str | None = None) -> str | None:
        """PUT ``key``; with ``if_match`` only if its ETag is still that one (``If-Match``), else
        PreconditionFailed (also when the key is gone). Returns the new ETag.

        A retried conditional PUT whose first attempt landed (its answer lost on the way) is
        answered 412 by the server; then the key is read back: holding our bytes, it is ours."""
        if if_match is None:
            result, _ = self._conditional_put(key, data, {})
            return getattr(result, "etag", None)
        try:
            result, _ = self._conditional_put(key, data, {"If-Match": if_match})
        except FileNotFoundError:
            raise PreconditionFailed(f"{self.uri_for(key)} is gone since it was read (another writer?)") from None
        except PreconditionFailed as err:
            if getattr(err, "attempts", 1) > 1 and self._holds(key, data):
                self._count("conditional_read_back")
                return self.etag(key)
            raise
        return getattr(result, "etag", None)

    def write_if_absent(self, key: str, data: bytes) -> bool:
        """Create ``key`` only if absent (``If-None-Match: *``); False if it exists. A retried
        request whose first attempt landed is answered 412: the key is then read back, and holding
        our bytes it counts as created (callers write content unique to them: holder, nonce)."""
        try:
            self._conditional_put(key, data, {"If-None-Match": "*"})
            return True
        except PreconditionFailed as err:
            if getattr(err, "attempts", 1) > 1 and self._holds(key, data):
                self._count("conditional_read_back")
                return True
            return False

    def upload_file(self, key: str, path: str | os.PathLike) -> None:
        """Single PUT below 64 MiB, else parallel 32 MiB multipart parts, each retried on its own."""
        size = os.path.getsize(path)
        name = self._name(key)
        if size < MULTIPART_THRESHOLD:
            data = Path(path).read_bytes()
            self._call("put", lambda: self._minio.put(
                self.bucket, name, data, {"Content-Type": "application/octet-stream"}), key=key)
            return
        from minio.datatypes import Part

        upload_id = self._call("multipart_create", lambda: self._minio.create_upload(self.bucket, name), key=key)
        offsets = list(range(0, size, PART_SIZE))

        def put_part(number: int, offset: int) -> Part:
            with open(path, "rb") as fh:
                fh.seek(offset)
                chunk = fh.read(PART_SIZE)
            etag = self._call("multipart_part", lambda: self._minio.upload_part(
                self.bucket, name, upload_id, number, chunk), key=key)
            return Part(number, etag)

        try:
            with concurrent.futures.ThreadPoolExecutor(PARALLEL_PARTS) as pool:
                parts = list(pool.map(put_part, range(1, len(offsets) + 1), offsets))
            self._call("multipart_complete", lambda: self._minio.complete_upload(
                self.bucket, name, upload_id, parts), key=key)
        except BaseException:
            self._abort_once(name, upload_id)
            raise

    def _abort_once(self, name: str, upload_id: str) -> None:
        """Best effort, one request, on a failure path: the error that got us here matters more;
        an upload this leaves is aborted by the next writer (``abort_incomplete_uploads``)."""
        with contextlib.suppress(Exception):
            self._count("multipart_abort")
            self._minio.abort_upload(self.bucket, name, upload_id)

    def download_file(self, key: str, path: str | os.PathLike) -> None:
        name = self._name(key)
        path = Path(path)
        tmp = path.with_name(f".{path.name}.download")

        def get() -> None:
            resp = self.client.get_object(self.bucket, name)
            try:
                with open(tmp, "wb") as fh:
                    for chunk in resp.stream(8 * 1024 * 1024):
                        fh.write(chunk)
            finally:
                resp.close()
                resp.release_conn()

        self._call("get", get, key=key)
        os.replace(tmp, path)

    def exists(self, key: str) -> bool:
        return self.etag(key) is not None

    def etag(self, key: str) -> str | None:
        name = self._name(key)
        try:
            return self._call("stat", lambda: self.client.stat_object(self.bucket, name), key=key).etag
        except FileNotFoundError:
            return None

    def list(self, prefix: str = "", recursive: bool = True) -> list[str]:
        """Keys under ``prefix`` relative to the root; non-recursive gives sub-"directories" with ``/``."""
        full = self._name(prefix) if prefix else (self.prefix + "/" if self.prefix else "")
        if prefix and prefix.endswith("/") and not full.endswith("/"):
            full += "/"
        if full and not full.endswith("/"):
            full += "/"
        strip = len(self.prefix) + 1 if self.prefix else 0

        def listing() -> list[str]:
            return [o.object_name[strip:] for o in
                    self.client.list_objects(self.bucket, prefix=full, recursive=recursive)]

        return sorted(self._call("list", listing, key=prefix))

    def delete(self, key: str) -> None:
        name = self._name(key)
        self._call("delete", lambda: self.client.remove_object(self.bucket, name), key=key)

    def delete_many(self, keys: Iterable[str]) -> None:
        """Batched DeleteObjects (up to 1000 keys per request)."""
        from minio.deleteobjects import DeleteObject

        names = [self._name(k) for k in keys]
        for i in range(0, len(names), 1000):
            batch = names[i:i + 1000]
            errors = self._call("delete_many", lambda: list(self.client.remove_objects(
                self.bucket, [DeleteObject(n) for n in batch])))
            if errors:
                raise TransientFailure(f"S3 could not delete {len(errors)} objects, e.g. {errors[0]}")

    def abort_incomplete_uploads(self, prefix: str) -> int:
        """Abort every incomplete multipart upload under the directory ``prefix`` (all of the store
        with ``""``): the parts a killed writer left, which no listing of objects shows and which
        the bucket keeps (and bills) until aborted. Every request (ListMultipartUploads, each
        AbortMultipartUpload) is retried like the others. Returns how many uploads were found and
        are gone now. Call it while holding the write lease, before this writer's first upload:
        it would abort the uploads of a live writer too.

        Raises:
            TransientFailure: a request still failed after the bounded retries (exit 138).
        """
        if prefix.strip("/"):
            full = self._name(prefix.strip("/")) + "/"
        else:
            full = self.prefix + "/" if self.prefix else ""
        strip = len(self.prefix) + 1 if self.prefix else 0
        gone, seen = 0, set()
        key_marker = upload_marker = None
        while True:
            page = self._call("multipart_list", lambda: self._minio.list_uploads(
                self.bucket, full, key_marker, upload_marker), key=prefix)
            for upload in page.uploads:
                if upload.upload_id in seen:
                    continue
                seen.add(upload.upload_id)
                try:
                    self._call("multipart_abort", lambda u=upload: self._minio.abort_upload(
                        self.bucket, u.object_name, u.upload_id), key=upload.object_name[strip:])
                except FileNotFoundError:  # NoSuchUpload: completed or aborted meanwhile (or our
                    pass                   # first attempt landed and its answer was lost)
                gone += 1
            if not page.is_truncated or not page.uploads:
                return gone
            key_marker, upload_marker = page.uploads[-1].object_name, page.uploads[-1].upload_id

    def uri_for(self, key: str) -> str:
        return _join(self.uri, key)


class _MultipartWriter:
    def __init__(self, store: S3Store, key: str):
        self.store, self.key, self.name = store, key, store._name(key)
        self.buf = bytearray()
        self.upload_id: str | None = None
        self.parts: list[concurrent.futures.Future] = []
        self.pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.closed = False

    def write(self, data: Any) -> None:
        view = _byte_view(data)
        while len(view):
            take = min(PART_SIZE - len(self.buf), len(view))
            self.buf += view[:take]
            view = view[take:]
            if len(self.buf) >= PART_SIZE:
                self._send_part()

    def _send_part(self) -> None:
        from minio.datatypes import Part

        store, chunk, self.buf = self.store, bytes(self.buf), bytearray()
        if self.upload_id is None:
            self.upload_id = store._call("multipart_create", lambda: store._minio.create_upload(
                store.bucket, self.name), key=self.key)
            self.pool = concurrent.futures.ThreadPoolExecutor(PARALLEL_PARTS)
        in_flight = [f for f in self.parts if not f.done()]
        if len(in_flight) >= PARALLEL_PARTS:  # bounded memory: wait for one to finish
            concurrent.futures.wait(in_flight, return_when=concurrent.futures.FIRST_COMPLETED)
        for f in self.parts:
            if f.done() and f.exception() is not None:
                raise f.exception()
        number = len(self.parts) + 1

        def put() -> Part:
            etag = store._call("multipart_part", lambda: store._minio.upload_part(
                store.bucket, self.name, self.upload_id, number, chunk), key=self.key)
            store._add_bytes("bytes_written", len(chunk))
            return Part(number, etag)

        self.parts.append(self.pool.submit(put))

    def close(self) -> None:
        if self.closed:
            return
        store = self.store
        try:
            if self.upload_id is None:
                data = bytes(self.buf)
                store._call("put", lambda: store._minio.put(
                    store.bucket, self.name, data, {"Content-Type": "application/octet-stream"}), key=self.key)
                store._add_bytes("bytes_written", len(data))
            else:
                if self.buf:
                    self._send_part()
                parts = [f.result() for f in self.parts]
                store._call("multipart_complete", lambda: store._minio.complete_upload(
                    store.bucket, self.name, self.upload_id, parts), key=self.key)
        except BaseException:
            self.abort()
            raise
        finally:
            if self.pool is not None:
                self.pool.shutdown(wait=True)
        self.closed = True

    def abort(self) -> None:
        self.closed = True
        self.buf = bytearray()
        if self.pool is not None:
            for f in self.parts:
                f.cancel()
            self.pool.shutdown(wait=True)
        if self.upload_id is not None:
            self.store._abort_once(self.name, self.upload_id)


def _certifi_where() -> str | None:
    try:
        import certifi

        return certifi.where()
    except ImportError:  # pragma: no cover - minio depends on certifi
        return None


def _is_transient(err: BaseException) -> bool:
    import urllib3.exceptions as ue
    from minio.error import InvalidResponseError, ServerError

    if isinstance(err, ServerError):
        return True
    if isinstance(err, InvalidResponseError):  # a non-S3 body: a proxy or gateway in the way
        return True
    if isinstance(err, (ue.HTTPError, ConnectionError, TimeoutError)):
        return not isinstance(err, ue.LocationValueError)
    return isinstance(err, OSError) and not isinstance(err, (FileNotFoundError, PermissionError))


_CHECKED_BUCKETS: set[tuple] = set()
"""(endpoint, bucket, credentials) one request of this process already proved: opening the same
store again (every step opens it a few times) costs no further request."""


def open_store(uri: str, *, retries: int | None = None, backoff: float | None = None) -> Store:
    """Open the store at ``uri``: a path, ``file:///path`` or ``s3://bucket/prefix``.

    The S3 backend is checked with one cheap request (bucket exists, credentials accepted), once per
    process for the same endpoint, bucket and credentials.

    Raises:
        BadInput: malformed URI, unsupported scheme, missing bucket, rejected credentials.
        TransientFailure: the endpoint could not be reached after the bounded retries.
    """
    from components.core.config import parse_store_uri

    try:
        scheme, where, prefix = parse_store_uri(uri)
    except ValueError as err:
        raise BadInput(str(err)) from None
    if scheme == "file":
        return FileStore(where)
    store = S3Store(where, prefix, retries=retries, backoff=backoff)
    settings = _s3_settings()
    secret = f"{settings['secret_key']}|{settings['session_token']}"
    proof = (settings["endpoint"], settings["secure"], where, settings["access_key"],
             hashlib.sha256(secret.encode()).hexdigest())
    if proof not in _CHECKED_BUCKETS:
        store.check()
        _CHECKED_BUCKETS.add(proof)
    return store


class _MinioCalls:
    """The one place where this module uses private APIs of its dependencies (minio 7.2.20's
    ``Minio._*`` S3 calls, urllib3 2.x's ``HTTPResponse._fp``); ``PINNED`` holds the signatures
    they had when written, and tests/core/test_storage.py fails when the installed minio differs.

    Why not minio's public API: ``put_object`` turns every header it is given into user metadata
    (``If-None-Match`` would be sent as ``X-Amz-Meta-If-None-Match``: no conditional write), pulls
    parts from a stream in its own thread (our writers push; a pipe between the two is one more
    copy of every byte), does not retry a part (one reset restarts nothing: it aborts the whole
    upload), and there is no public ListMultipartUploads. Their public ``get_object`` returns the
    urllib3 response; its ``readinto`` reads into a new bytes object and copies, where
    ``_fp.readinto`` (http.client) fills our buffer from the socket.
    """

    PINNED = {
        "_put_object": "(self, bucket_name: 'str', object_name: 'str', data: 'bytes', headers: "
                       "'Optional[DictType]' = None, query_params: 'Optional[DictType]' = None) "
                       "-> 'ObjectWriteResult'",
        "_create_multipart_upload": "(self, bucket_name: 'str', object_name: 'str', headers: 'DictType') -> 'str'",
        "_upload_part": "(self, bucket_name: 'str', object_name: 'str', data: 'bytes', headers: "
                        "'Optional[DictType]', upload_id: 'str', part_number: 'int') -> 'str'",
        "_complete_multipart_upload": "(self, bucket_name: 'str', object_name: 'str', upload_id: 'str', "
                                      "parts: 'list[Part]', ssec: 'Optional[SseCustomerKey]' = None) "
                                      "-> 'CompleteMultipartUploadResult'",
        "_abort_multipart_upload": "(self, bucket_name: 'str', object_name: 'str', upload_id: 'str')",
        "_list_multipart_uploads": "(self, bucket_name: 'str', delimiter: 'Optional[str]' = None, "
                                   "encoding_type: 'Optional[str]' = None, key_marker: 'Optional[str]' = None, "
                                   "max_uploads: 'Optional[int]' = None, prefix: 'Optional[str]' = None, "
                                   "upload_id_marker: 'Optional[str]' = None, extra_headers: "
                                   "'Optional[DictType]' = None, extra_query_params: 'Optional[DictType]' = None) "
                                   "-> 'ListMultipartUploadsResult'",
    }

    def __init__(self, client: Any):
        self.client = client

    def put(self, bucket: str, name: str, data: bytes, headers: dict[str, str]) -> Any:
        """PutObject with our headers as they are (``If-None-Match``, ``If-Match``)."""
        return self.client._put_object(bucket, name, data, headers=dict(headers))

    def create_upload(self, bucket: str, name: str) -> str:
        """CreateMultipartUpload; returns the upload id."""
        return self.client._create_multipart_upload(bucket, name, {"Content-Type": "application/octet-stream"})

    def upload_part(self, bucket: str, name: str, upload_id: str, number: int, data: bytes) -> str:
        """UploadPart; returns the part's ETag."""
        return self.client._upload_part(bucket, name, data, None, upload_id, number)

    def complete_upload(self, bucket: str, name: str, upload_id: str, parts: list) -> Any:
        return self.client._complete_multipart_upload(bucket, name, upload_id, parts)

    def abort_upload(self, bucket: str, name: str, upload_id: str) -> None:
        self.client._abort_multipart_upload(bucket, name, upload_id)

    def list_uploads(self, bucket: str, prefix: str, key_marker: str | None, upload_id_marker: str | None) -> Any:
        """One page of ListMultipartUploads under ``prefix`` (``.uploads``, ``.is_truncated``).
        minio 7.2.20 never fills ``next_upload_id_marker``: the caller takes the markers from the
        page's last upload."""
        return self.client._list_multipart_uploads(bucket, prefix=prefix, key_marker=key_marker,
                                                   upload_id_marker=upload_id_marker, max_uploads=1000)

    @staticmethod
    def socket_readinto(resp: Any) -> Callable[[memoryview], int] | None:
        """The ``readinto`` of the http.client response under urllib3's, which fills a buffer
        straight from the socket; None where it is not there or the body is encoded."""
        raw = getattr(resp, "_fp", None)
        if raw is None or not hasattr(raw, "readinto") or resp.headers.get("content-encoding"):
            return None
        return raw.readinto
