"""The object stores' one protocol (S3, GCS, Azure Blob and any other), over thin provider drivers.

:class:`ObjectStore` is the :class:`~relaunch.components.core.store.Store` of every object store: the check
once per process at open, bounded retries with full-jitter backoff, ranged reads into the caller's
buffers, sizes and listings, conditional writes and their read-back after a retried 412, the
streaming writer (parts in parallel, nothing visible before ``close``, ``abort`` drops what went up)
and the cleanup of uploads a killed writer left. A driver (:class:`ObjectDriver`: ``s3.py``,
``gcs.py``, ``azure.py``) only turns each request into its SDK's call and each SDK error into a
:class:`Fault`, by the error's type and code; a new provider is one driver module with
``@register_backend`` and one import line at the end of ``store/__init__.py``.

Retry tuning, for every object store: ``RELAUNCH_STORE_RETRIES`` (attempts, default 8) and
``RELAUNCH_STORE_BACKOFF`` (first backoff in seconds, default 0.1).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import enum
import errno
import os
import random
import threading
import time
from pathlib import Path
from typing import Any, Callable, ClassVar, ContextManager, Iterable, TypeVar

from ..contract.errors import BadInput, TransientFailure
from . import (READ_BLOCK, WRITE_OPS, PreconditionFailed, Segments, StreamWriter, byte_view,
               check_key, join_uri, refused_write)

T = TypeVar("T")

PARALLEL_DELETES = 4
"""Single-key deletions in flight at once, for a driver without a batched delete."""

CHECKED: set[tuple] = set()
"""(scheme, location, credentials) one request of this process already proved: opening the same store
again (every step opens it a few times) costs no further request."""


class Fault(enum.Enum):
    """What an SDK's error means to the store; a driver's :meth:`ObjectDriver.fault` says which."""

    NOT_FOUND = "no such object"                          # FileNotFoundError
    NO_CONTAINER = "no such bucket or container"           # BadInput
    PRECONDITION = "a conditional write lost"             # PreconditionFailed
    SHORT = "the object ends before the range"            # EOFError
    FORBIDDEN = "refused for good"                        # a write: StoreUnwritable; else BadInput
    CREDENTIALS = "credentials refused"                   # BadInput
    TRANSIENT = "worth retrying"                          # retried, then TransientFailure (138)
    PERMANENT = "any other refusal"                       # BadInput


class ObjectDriver:
    """A provider's translation of the store's requests; subclasses set the class attributes and
    implement the methods below. ``name`` arguments are full object names (the store's prefix
    included); a method raises its SDK's errors as they come, :meth:`fault` classifies them."""

    scheme: ClassVar[str]
    """The URI scheme (``s3``)."""
    example: ClassVar[str]
    """How its URIs are written (``s3://bucket/prefix``)."""
    service: ClassVar[str]
    """The provider's name in error messages (``S3``)."""
    container_kind: ClassVar[str] = "bucket"
    """What a URI's location is called (``bucket``, ``container``)."""
    credentials_hint: ClassVar[str]
    """Where credentials come from, for the line that says they were refused."""
    uri_hint: ClassVar[str]
    """How to give endpoint and credentials instead of writing them into the URI."""
    CHECK_OP: ClassVar[str]
    """The request that proves endpoint, credentials and location (a counter name, as all ``*_OP``)."""
    START_OP: ClassVar[str | None]
    """Starting an upload in parts (None: starting makes no request)."""
    PART_OP: ClassVar[str]
    FINISH_OP: ClassVar[str | None]
    """Committing the parts (None: the last part does)."""
    ABORT_OP: ClassVar[str]
    UPLOAD_LIST_OP: ClassVar[str | None] = None
    """Listing the uploads killed writers left (None: the provider keeps none worth aborting)."""
    ABORT_LEAVES_OBJECT: ClassVar[bool] = False
    """An aborted upload leaves an empty object to delete (Azure commits an empty block list)."""
    DELETE_BATCH: ClassVar[int] = 0
    """Keys per batched delete request (0: one request per key)."""
    parallel_parts: ClassVar[int] = 4
    """Parts of one upload in flight at once (1: the provider takes them in order only)."""
    part_size: int
    """Bytes per part of an upload; the last one may be smaller."""
    single_put_limit: int
    """A file smaller than this goes up in one request (``upload_file``)."""
    location: str
    endpoint: str

    @classmethod
    def check_location(cls, location: str) -> None:
        """ValueError (one line) for a location name the provider refuses."""

    @classmethod
    def parse(cls, uri: str) -> tuple[str, str]:
        """``(location, prefix)`` of ``scheme://location/prefix``.

        Raises:
            ValueError: no location, credentials or a port in it, an invalid name, '.' or '..' parts.
        """
        location, _, prefix = uri.split("://", 1)[1].partition("/")
        if not location:
            raise ValueError(f"{cls.scheme} URI {uri!r} has no {cls.container_kind}; write {cls.example}")
        if "@" in location or ":" in location:
            raise ValueError(f"{cls.scheme} URI must not carry credentials or a port; {cls.uri_hint}")
        cls.check_location(location)
        if any(p in ("..", ".") for p in prefix.split("/")):
            raise ValueError(f"{cls.scheme} URI {uri!r} must not contain '.' or '..' path parts")
        return location, prefix

    @classmethod
    def open(cls, location: str, prefix: str, *, retries: int | None = None,
             backoff: float | None = None) -> "ObjectStore":
        """The store at a parsed URI, checked with one request once per process (:meth:`ObjectStore.open`).

        Raises:
            BadInput: no or rejected credentials, a missing bucket or container.
            TransientFailure: the endpoint could not be reached after the bounded retries.
        """
        return ObjectStore.open(cls(location), prefix, retries=retries, backoff=backoff)

    def identity(self) -> tuple:
        """What the check at open proves besides the location: endpoint and credentials (digested)."""
        raise NotImplementedError

    def fault(self, err: BaseException, op: str) -> tuple[Fault, Any] | None:
        """``(fault, code)`` of an SDK error met in request ``op`` (code: the error code or HTTP
        status, for the message), None for an error that is not the SDK's."""
        raise NotImplementedError

    def check(self) -> bool:
        """One cheap request; False when the location does not exist."""
        raise NotImplementedError

    def get(self, name: str) -> bytes:
        raise NotImplementedError

    def open_range(self, name: str, offset: int, length: int) -> ContextManager[Callable[[memoryview], int]]:
        """A GET of ``length`` bytes from ``offset``; yields a ``readinto`` of the body (0 at its end)."""
        raise NotImplementedError

    def download(self, name: str, path: Path) -> None:
        """The object into the local file ``path``."""
        raise NotImplementedError

    def put(self, name: str, data: bytes, *, if_absent: bool = False, if_match: str | None = None) -> str | None:
        """One request that writes ``data``, only if absent or only if its version is ``if_match``;
        returns the new version (ETag, generation)."""
        raise NotImplementedError

    def version(self, name: str) -> str | None:
        """The object's version (ETag, generation); None, or the SDK's not-found error, if absent."""
        raise NotImplementedError

    def listing(self, prefix: str, recursive: bool) -> Iterable[tuple[str, int | None]]:
        """``(name, size)`` of the objects under ``prefix``; not recursive, also ``(name/, None)`` of
        each "directory" below it."""
        raise NotImplementedError

    def delete(self, name: str) -> None:
        raise NotImplementedError

    def delete_batch(self, names: list[str]) -> list:
        """Delete up to DELETE_BATCH names in one request; returns the per-key errors."""
        raise NotImplementedError

    def start_upload(self, name: str) -> Any:
        """Start an upload in parts; returns its handle."""
        raise NotImplementedError

    def upload_part(self, name: str, handle: Any, number: int, offset: int, data: bytes, total: int | None,
                    retried: bool) -> Any:
        """Send part ``number`` (from 1), the bytes from ``offset``; ``total``: the object's size when
        this is the last part; ``retried``: an earlier attempt of this part failed. Returns what
        :meth:`finish_upload` needs of it."""
        raise NotImplementedError

    def finish_upload(self, name: str, handle: Any, parts: list) -> None:
        raise NotImplementedError

    def abort_upload(self, name: str, handle: Any) -> None:
        """Drop an upload's parts (the SDK's not-found: gone already; precondition: it was committed)."""
        raise NotImplementedError

    def incomplete_uploads(self, prefix: str) -> list[tuple[str, Any]]:
        """``(name, handle)`` of the uploads under ``prefix`` never finished (all pages)."""
        raise NotImplementedError


class ObjectStore:
    """The :class:`~relaunch.components.core.store.Store` of an object store: the protocol, once, over ``driver``."""

    def __init__(self, driver: ObjectDriver, prefix: str = "", *, retries: int | None = None,
                 backoff: float | None = None):
        self.driver, self.prefix = driver, prefix.strip("/")
        self.uri = f"{driver.scheme}://{driver.location}/{self.prefix}".rstrip("/")
        self.stats: collections.Counter = collections.Counter()
        self._stats_lock = threading.Lock()
        self.retries = int(retries if retries is not None else os.environ.get("RELAUNCH_STORE_RETRIES", 8))
        self.backoff = float(backoff if backoff is not None else os.environ.get("RELAUNCH_STORE_BACKOFF", 0.1))
        self.max_backoff = 5.0
        # its own generator, never the global ``random`` a training's RNG stream lives in: a retried
        # request would shift that stream and break an exact resume
        self._jitter = random.Random()

    @classmethod
    def open(cls, driver: ObjectDriver, prefix: str, **options: Any) -> "ObjectStore":
        """The store, checked with one cheap request (location exists, credentials accepted) once per
        process for the same provider, location, endpoint and credentials."""
        store = cls(driver, prefix, **options)
        proof = (driver.scheme, driver.location, driver.identity())
        if proof not in CHECKED:
            store.check()
            CHECKED.add(proof)
        return store

    # -- plumbing
    def _name(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _dir_name(self, prefix: str) -> str:
        """The full name of the directory ``prefix`` with its trailing ``/`` ("" or the store's own for "")."""
        full = self._name(prefix.strip("/")) if prefix.strip("/") else self.prefix
        return full + "/" if full else ""

    def _count(self, op: str, n: int = 1) -> None:
        with self._stats_lock:
            self.stats[op] += n
            self.stats["requests"] += n

    def _add_bytes(self, what: str, n: int) -> None:
        with self._stats_lock:
            self.stats[what] += n

    def _back_off(self, delay: float) -> float:
        """Sleep a full-jitter share of ``delay`` (counted in ``stats``); returns the next delay."""
        sleep = self._jitter.uniform(0, delay)
        with self._stats_lock:
            self.stats["retries"] += 1
            self.stats["retry_seconds"] += sleep
        time.sleep(sleep)
        return min(delay * 2, self.max_backoff)

    def _call(self, op: str | None, fn: Callable[[], T], *, key: str = "") -> T:
        """Run one request (``op`` None: ``fn`` makes none) with bounded retries of transient
        failures; raise the store's error for a permanent one."""
        if op is None:
            return fn()
        delay, last = self.backoff, None
        for attempt in range(1, self.retries + 1):
            self._count(op)
            try:
                return fn()
            except Exception as err:  # noqa: BLE001 - classified by the driver, by type and code
                fault = self.driver.fault(err, op) or _io_fault(err)
                if fault is None:
                    raise
                if fault[0] is not Fault.TRANSIENT:
                    raise self._error(fault[0], fault[1], op, key) from None
                last = err
            if attempt == self.retries:
                break
            delay = self._back_off(delay)
        first = str(last).strip().splitlines()[0][:200] if str(last).strip() else ""
        raise TransientFailure(f"{self.driver.service} {op} {self.uri_for(key)} failed {self.retries} times; "
                               f"last error: {type(last).__name__}: {first}")

    def _error(self, fault: Fault, code: Any, op: str, key: str) -> Exception:
        where, driver = self.uri_for(key), self.driver
        if fault is Fault.NOT_FOUND:
            return FileNotFoundError(where)
        if fault is Fault.SHORT:
            return EOFError(f"{where} is shorter than the range asked for")
        if fault is Fault.PRECONDITION:
            return PreconditionFailed(f"{where} exists or changed since it was read (another writer?)")
        if fault is Fault.NO_CONTAINER:
            return self._no_container()
        if fault is Fault.FORBIDDEN and op in WRITE_OPS:
            return refused_write(driver.service, op, where, code)
        if fault in (Fault.FORBIDDEN, Fault.CREDENTIALS):
            return BadInput(f"{driver.service} refused {op} on {where}: {code} (check {driver.credentials_hint})")
        return BadInput(f"{driver.service} error on {op} {where}: {code}"[:300])

    def _no_container(self) -> BadInput:
        d = self.driver
        return BadInput(f"{d.container_kind} {d.location!r} does not exist at {d.endpoint}; create it or fix the "
                        f"store URI")

    def _put(self, key: str, data: bytes, **condition: Any) -> str | None:
        """One write request (retried); a lost precondition carries how many attempts were made."""
        name, attempts = self._name(key), [0]

        def put() -> str | None:
            attempts[0] += 1
            return self.driver.put(name, data, **condition)

        try:
            version = self._call("put", put, key=key)
        except PreconditionFailed as err:
            err.attempts = attempts[0]  # type: ignore[attr-defined]
            raise
        self._add_bytes("bytes_written", len(data))
        return version

    def _landed_before(self, err: PreconditionFailed, key: str, data: bytes) -> bool:
        """Whether a 412 answered a retry of a write whose first attempt landed (its answer lost on the
        way): the key then holds our bytes (callers write content unique to them: holder, nonce)."""
        if getattr(err, "attempts", 1) < 2:
            return False
        try:
            ours = self.read_bytes(key) == data
        except FileNotFoundError:
            return False
        if ours:
            self._count("conditional_read_back")
        return ours

    def _abort_once(self, name: str, handle: Any) -> None:
        """Best effort, one request, on a failure path: the error that got us here matters more; an
        upload this leaves is dropped by the next writer (``abort_incomplete_uploads``)."""
        with contextlib.suppress(Exception):
            self._count(self.driver.ABORT_OP)
            self.driver.abort_upload(name, handle)
            if self.driver.ABORT_LEAVES_OBJECT:
                self._count("delete")
                self.driver.delete(name)

    # -- the interface
    def check(self) -> None:
        """One cheap request that proves endpoint, credentials and bucket (or container)."""
        if self._call(self.driver.CHECK_OP, self.driver.check) is False:
            raise self._no_container()

    def read_bytes(self, key: str) -> bytes:
        name = self._name(key)
        data = self._call("get", lambda: self.driver.get(name), key=key)
        self._add_bytes("bytes_read", len(data))
        return data

    def read_into(self, key: str, offset: int, buffer: Any, *, sink: Callable[[int], None] | None = None) -> None:
        """One ranged GET of the bytes that fill ``buffer`` (a writable buffer, or a list of them
        filled one after another) from ``offset``, from the response body into the buffers, with
        ``sink(bytes filled so far)`` after each READ_BLOCK (a retried request starts over at
        ``sink(0)``). FileNotFoundError if absent; EOFError if short."""
        segments = Segments(buffer)
        total = segments.total
        if not total:
            return
        name = self._name(key)

        def get() -> int:
            if sink is not None:
                sink(0)
            with self.driver.open_range(name, offset, total) as readinto:
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

        done = self._call("get_range", get, key=key)
        if done < total:
            raise EOFError(f"{self.uri_for(key)} ends {total - done} bytes before the range asked for")
        self._add_bytes("bytes_read", done)

    def open_writer(self, key: str) -> StreamWriter:
        """Stream ``key`` up: one request when it stays within one part, else an upload in parts that
        go up while the caller writes on (nothing is visible under the key before ``close``)."""
        self._count("open_writer")
        return UploadWriter(self, key)

    def sizes(self, prefix: str) -> dict[str, int]:
        """``{key: size}`` of the objects directly under ``prefix`` (one listing)."""
        full, strip = self._name(prefix.rstrip("/")) + "/", len(self.prefix) + 1 if self.prefix else 0
        found = self._call("list", lambda: list(self.driver.listing(full, False)), key=prefix)
        return {name[strip:]: size for name, size in found if size is not None}

    def write_bytes(self, key: str, data: bytes, *, if_match: str | None = None) -> str | None:
        """Write ``key``; with ``if_match`` only if its version is still that one, else
        PreconditionFailed (also when the key is gone). Returns the new version (ETag, generation).
        A retried conditional write whose first attempt landed is answered 412: the key is then
        read back, and holding our bytes it is ours."""
        if if_match is None:
            return self._put(key, data)
        try:
            return self._put(key, data, if_match=if_match)
        except FileNotFoundError:
            raise PreconditionFailed(f"{self.uri_for(key)} is gone since it was read (another writer?)") from None
        except PreconditionFailed as err:
            if self._landed_before(err, key, data):
                return self.etag(key)
            raise

    def write_if_absent(self, key: str, data: bytes) -> bool:
        """Create ``key`` only if absent; False if it exists (a retried request whose first attempt
        landed counts as created when the key holds our bytes)."""
        try:
            self._put(key, data, if_absent=True)
            return True
        except PreconditionFailed as err:
            return self._landed_before(err, key, data)

    def upload_file(self, key: str, path: str | os.PathLike) -> None:
        """One request below the driver's single-put limit, else parts, each retried on its own."""
        if os.path.getsize(path) < self.driver.single_put_limit:
            self._put(key, Path(path).read_bytes())
            return
        writer = self.open_writer(key)
        try:
            with open(path, "rb") as fh:
                while chunk := fh.read(self.driver.part_size):
                    writer.write(chunk)
        except BaseException:
            writer.abort()
            raise
        writer.close()

    def download_file(self, key: str, path: str | os.PathLike) -> None:
        name, path = self._name(key), Path(path)
        tmp = path.with_name(f".{path.name}.download")
        self._call("get", lambda: self.driver.download(name, tmp), key=key)
        os.replace(tmp, path)

    def exists(self, key: str) -> bool:
        return self.etag(key) is not None

    def etag(self, key: str) -> str | None:
        """The version of ``key`` (what ``write_bytes(if_match=...)`` takes), None if absent."""
        name = self._name(key)
        try:
            return self._call("stat", lambda: self.driver.version(name), key=key)
        except FileNotFoundError:
            return None

    def list(self, prefix: str = "", recursive: bool = True) -> list[str]:
        """Keys under ``prefix`` relative to the root; non-recursive gives sub-"directories" with ``/``."""
        full = self._name(prefix) if prefix else (self.prefix + "/" if self.prefix else "")
        if full and not full.endswith("/"):
            full += "/"
        strip = len(self.prefix) + 1 if self.prefix else 0
        found = self._call("list", lambda: list(self.driver.listing(full, recursive)), key=prefix)
        return sorted(name[strip:] for name, _ in found)

    def delete(self, key: str) -> None:
        """Delete ``key``; a missing key is no error."""
        name = self._name(key)
        with contextlib.suppress(FileNotFoundError):
            self._call("delete", lambda: self.driver.delete(name), key=key)

    def delete_many(self, keys: Iterable[str]) -> None:
        """Batched deletes where the provider has them, else a few single ones in parallel."""
        keys = list(keys)
        batch = self.driver.DELETE_BATCH
        if not batch:
            with concurrent.futures.ThreadPoolExecutor(PARALLEL_DELETES) as pool:
                list(pool.map(self.delete, keys))
            return
        names = [self._name(k) for k in keys]
        for i in range(0, len(names), batch):
            part = names[i:i + batch]
            errors = self._call("delete_many", lambda: self.driver.delete_batch(part))
            if errors:
                raise TransientFailure(f"{self.driver.service} could not delete {len(errors)} objects, "
                                       f"e.g. {errors[0]}")

    def abort_incomplete_uploads(self, prefix: str) -> int:
        """Drop every upload never finished under the directory ``prefix`` (all of the store with
        ``""``): the parts a killed writer left, which no listing of objects shows and which the
        provider keeps (and may bill) until dropped. Every request is retried like the others.
        Returns how many were found and are gone now (0 where the provider keeps none: GCS). Call
        it while holding the write lease, before this writer's first upload: it would drop the
        uploads of a live writer too.

        Raises:
            TransientFailure: a request still failed after the bounded retries (exit 138).
        """
        driver = self.driver
        if driver.UPLOAD_LIST_OP is None:
            return 0
        full, strip = self._dir_name(prefix), len(self.prefix) + 1 if self.prefix else 0
        gone = 0
        for name, handle in self._call(driver.UPLOAD_LIST_OP, lambda: driver.incomplete_uploads(full), key=prefix):
            key = name[strip:]
            try:
                self._call(driver.ABORT_OP, lambda n=name, h=handle: driver.abort_upload(n, h), key=key)
            except FileNotFoundError:  # finished or dropped meanwhile (or our first attempt landed)
                pass
            except PreconditionFailed:  # committed meanwhile by someone: not ours to drop
                continue
            if driver.ABORT_LEAVES_OBJECT:
                with contextlib.suppress(FileNotFoundError):
                    self._call("delete", lambda n=name: driver.delete(n), key=key)
            gone += 1
        return gone

    def uri_for(self, key: str) -> str:
        return join_uri(self.uri, key)


PART_SLACK = 16
"""A writer holds up to a part and 1/16 more before it sends a part: a file of one part and a tail (a
checkpoint's data file is its tensor bytes and their archive records, a few KB over) goes up as one
request, not a full part then a tail that finishes the upload in a request of its own (on
fake-gcs-server that last request took 1.4-1.9 s of a 64 MiB file's 2.3-2.7 s: the server finalizes
the object there)."""


class UploadWriter:
    """A key written front to back (:meth:`ObjectStore.open_writer`). Buffers one part (and
    :data:`PART_SLACK` of it more); a key that stays within that is one write request at ``close``,
    a larger one an upload in parts, sent when more data follows them (so the last part is known as
    such) and at most ``parallel_parts`` in flight (bounded memory), each retried on its own;
    ``close`` finishes the upload, ``abort`` drops what went up."""

    def __init__(self, store: ObjectStore, key: str):
        self.store, self.driver, self.key, self.name = store, store.driver, key, store._name(key)
        self.buf = bytearray()
        self.handle: Any = None
        self.started = False
        self.sent = 0
        self.parts: list[concurrent.futures.Future] = []
        self.pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.closed = False

    def write(self, data: Any) -> None:
        view, size = byte_view(data), self.driver.part_size
        limit = size + size // PART_SLACK
        while len(view):
            if len(self.buf) >= limit:  # more follows: a part goes, not the last
                self._send(final=False)
            take = min(limit - len(self.buf), len(view))
            self.buf += view[:take]
            view = view[take:]

    def _send(self, *, final: bool) -> None:
        store, driver = self.store, self.driver
        if final:
            chunk, self.buf = bytes(self.buf), bytearray()
        else:  # one part of part_size (GCS: a multiple of 256 KiB); what is over it waits for the next
            size = driver.part_size
            chunk, self.buf = bytes(memoryview(self.buf)[:size]), self.buf[size:]
        if not self.started:
            self.handle = store._call(driver.START_OP, lambda: driver.start_upload(self.name), key=self.key)
            self.started = True
            self.pool = concurrent.futures.ThreadPoolExecutor(driver.parallel_parts)
        in_flight = [f for f in self.parts if not f.done()]
        if len(in_flight) >= driver.parallel_parts:
            concurrent.futures.wait(in_flight, return_when=concurrent.futures.FIRST_COMPLETED)
        for f in self.parts:
            if f.done() and f.exception() is not None:
                raise f.exception()
        number, offset = len(self.parts) + 1, self.sent
        total = offset + len(chunk) if final else None
        self.sent += len(chunk)

        def put() -> Any:
            tries = [0]

            def attempt() -> Any:
                tries[0] += 1
                return driver.upload_part(self.name, self.handle, number, offset, chunk, total, tries[0] > 1)

            token = store._call(driver.PART_OP, attempt, key=self.key)
            store._add_bytes("bytes_written", len(chunk))
            return token

        self.parts.append(self.pool.submit(put))

    def close(self) -> None:
        if self.closed:
            return
        store, driver = self.store, self.driver
        try:
            if not self.started:
                store._put(self.key, bytes(self.buf))
            else:
                self._send(final=True)
                parts = [f.result() for f in self.parts]
                if driver.FINISH_OP is not None:
                    store._call(driver.FINISH_OP, lambda: driver.finish_upload(self.name, self.handle, parts),
                                key=self.key)
        except BaseException:
            self.abort()
            raise
        finally:
            if self.pool is not None:
                self.pool.shutdown(wait=True)
        self.closed = True

    def abort(self) -> None:
        """Stop sending and drop what went up (best effort; what is left, the next writer's
        ``abort_incomplete_uploads`` drops, or the provider's expiry)."""
        self.closed = True
        self.buf = bytearray()
        if self.pool is not None:
            for f in self.parts:
                f.cancel()
            self.pool.shutdown(wait=True)
        if self.started:
            self.started = False
            self.store._abort_once(self.name, self.handle)


def readinto_of(chunks: Iterable[bytes]) -> Callable[[memoryview], int]:
    """A ``readinto`` over a body an SDK hands out in chunks (0 at its end)."""
    pieces, rest = iter(chunks), memoryview(b"")

    def readinto(view: memoryview) -> int:
        nonlocal rest
        while not len(rest):
            chunk = next(pieces, None)
            if chunk is None:
                return 0
            rest = memoryview(chunk).cast("B")
        n = min(len(view), len(rest))
        view[:n] = rest[:n]
        rest = rest[n:]
        return n

    return readinto


def socket_readinto(resp: Any) -> Callable[[memoryview], int] | None:
    """The ``readinto`` of the http.client response under a urllib3 2.x response (``_fp``), which fills
    our buffer straight from the socket; None where it is not there or the body is encoded. urllib3's
    own ``readinto`` reads into a new bytes object and copies it (GCS restore of 128 MiB here: 0.28 s
    through it, and the copy is what the raw ``http.client`` reads of the bench do not make);
    tests/core/test_storage.py and test_store_gcs.py fail when urllib3 no longer has it."""
    raw = getattr(resp, "_fp", None)
    if raw is None or not hasattr(raw, "readinto") or resp.headers.get("content-encoding"):
        return None
    return raw.readinto


_UNWRITABLE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)


def _io_fault(err: BaseException) -> tuple[Fault, Any] | None:
    """A connection that broke below the SDK (reset, timeout, any other socket error) is transient;
    a missing, refused, full or read-only local file (a download's) is not the store's to retry."""
    if isinstance(err, (FileNotFoundError, PermissionError)) or not isinstance(err, OSError):
        return None
    if err.errno in _UNWRITABLE_ERRNOS:
        return None
    return Fault.TRANSIENT, type(err).__name__
