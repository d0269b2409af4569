"""One small storage interface, backends chosen by the scheme of a URI.

    store = open_store("/shared/exp")              # or file:///shared/exp
    store = open_store("s3://bucket/exp/run")      # endpoint and credentials from the environment

Keys are ``/``-separated and relative to the store root. This module holds what every backend
shares: the :class:`Store` and :class:`StreamWriter` protocols, :class:`PreconditionFailed`, the key
and buffer helpers, and the registry of backends by URI scheme that :func:`parse_store_uri` (the
configuration's rule) and :func:`open_store` both go through. Each backend is one module beside this
one (``file.py``: POSIX directories, ``s3.py``: S3-compatible buckets, ...) whose class carries
``@register_backend``.

Adding a backend: a new module here whose class implements :class:`Store`, says its ``scheme`` and
an ``example`` URI, parses its URIs (``parse``) and opens a store (``open``), decorated with
``@register_backend``; and one line importing it at the end of this file. An object store is only a
driver (``object_store.ObjectDriver``: ``s3.py``, ``gcs.py``, ``azure.py``): the protocol (retries,
ranged reads, conditional writes, uploads in parts) is ``object_store.ObjectStore``'s, written once.
Nothing else changes: the configuration, every command and the checkpoint code accept the new
scheme through the registry.
"""

from __future__ import annotations

import bisect
import collections
import errno
import os
import re
import secrets
from typing import Any, Callable, ClassVar, Iterable, Protocol, TypeVar, runtime_checkable

from ..contract.classify import is_store_unwritable
from ..contract.errors import BadInput, StoreUnwritable

# A ranged read fills its buffers in blocks of this size and reports each (``sink``): small enough
# that a check of the block (a digest) finds it still in the CPU's cache, which made the digest
# almost free here (measured: 512 KiB blocks read+digest ~ a plain read; 1 MiB and up ~ +40%).
READ_BLOCK = 512 * 1024


class PreconditionFailed(BadInput):
    """A conditional write lost: the key existed, or changed since it was read (a second writer)."""

    kind = "precondition-failed"  # carried to the other ranks as itself (errors.CarriedError)


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


class Backend(Protocol):
    """What the registry needs from a backend class besides the :class:`Store` methods."""

    scheme: ClassVar[str]
    """The URI scheme it serves (``s3`` for ``s3://...``)."""
    example: ClassVar[str]
    """How its URIs are written, for error messages (``s3://bucket/prefix``)."""

    @classmethod
    def parse(cls, uri: str) -> tuple[str, str]:
        """``(location, prefix)`` of a URI of this scheme; ValueError (one line: what is wrong and
        how to write it) for a malformed one. No I/O: the configuration calls it."""
        ...

    @classmethod
    def open(cls, location: str, prefix: str, **options: Any) -> Store:
        """The store at a parsed URI; ``options`` are open_store's keywords that were given
        (``retries``, ``backoff``): a backend ignores those it has no use for."""
        ...


BACKENDS: dict[str, type] = {}
"""The registered backend classes by URI scheme (``register_backend``)."""
PATH_SCHEME = "file"
"""The backend of a URI without a scheme (a plain path)."""
_SCHEME_PREFIX = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):(.*)$", re.S)

B = TypeVar("B", bound=type)


def register_backend(cls: B) -> B:
    """Register ``cls`` (a :class:`Backend` whose instances are :class:`Store`) for its ``scheme``;
    usable as a class decorator. Registering a scheme twice replaces the first backend."""
    if not re.fullmatch(r"[a-z][a-z0-9+.-]*", getattr(cls, "scheme", "") or ""):
        raise ValueError(f"backend {cls.__name__} needs a lowercase URI scheme in its 'scheme' attribute")
    BACKENDS[cls.scheme] = cls
    return cls


def _choices() -> str:
    """``a path, file:///path or s3://bucket/prefix``: the ways to write a store URI."""
    ways = ["a path"] + [BACKENDS[s].example for s in BACKENDS]
    return ", ".join(ways[:-1]) + " or " + ways[-1] if len(ways) > 1 else ways[0]


def parse_store_uri(uri: str) -> tuple[str, str, str]:
    """Split a store URI into ``(scheme, location, prefix)``: ``("file", path, "")`` for a path or
    ``file:///path``, ``("s3", bucket, prefix)`` for ``s3://bucket/prefix``, and so on for each
    registered backend; the one set of rules the configuration and :func:`open_store` apply.

    A value that starts like a URI (``<scheme>:``, two characters or more: one letter is a Windows
    drive) must be a well-formed URI of a registered backend: ``s3:/bucket/x``, ``s3:bucket/x``,
    ``S3://bucket/x``, ``gs:bucket``, ``file:relative`` or ``foo:bar`` are refused rather than taken
    as a local directory of that name (``./foo:bar`` is one).

    Raises:
        ValueError: one line saying what is wrong and how to write it.
    """
    if not isinstance(uri, str) or not uri.strip():
        raise ValueError(f"store URI is empty; use {_choices()}")
    match = _SCHEME_PREFIX.match(uri)
    if match is None or len(match[1]) < 2:
        scheme = PATH_SCHEME
    else:
        scheme = match[1]
        _refuse_malformed_scheme(uri, scheme, match[2])
    backend = BACKENDS[scheme]
    location, prefix = backend.parse(uri)
    return scheme, location, prefix


def _refuse_malformed_scheme(uri: str, scheme: str, rest: str) -> None:
    """Nothing for ``<registered scheme>://...``; ValueError naming the fix for any other ``<scheme>:``."""
    lower = scheme.lower()
    if scheme in BACKENDS and rest.startswith("//"):
        return
    if rest.startswith("//"):
        if lower in BACKENDS:
            raise ValueError(f"store URI {uri!r}: write the scheme in lowercase: {lower}:{rest}")
        raise ValueError(f"store URI scheme {scheme!r} is not supported; use {_choices()}")
    local = f"for a local directory of that name write ./{uri}"
    if lower not in BACKENDS:
        raise ValueError(f"store URI {uri!r} is not a path but a {scheme} URI, and {scheme} is not supported; "
                         f"use {_choices()} ({local})")
    if lower == PATH_SCHEME and not rest.startswith("/"):
        fix = f"write the relative path without file: ({rest or '.'}), or the URI as file:///absolute/path"
    elif not rest.strip("/"):
        fix = f"write the URI as {BACKENDS[lower].example}"
    else:
        fix = f"write the URI as {lower}:{'///' if lower == PATH_SCHEME else '//'}{rest.lstrip('/')}"
    raise ValueError(f"store URI {uri!r} is not a path; {fix} ({local})")


WRITE_OPS = frozenset({"put", "multipart_create", "multipart_part", "multipart_complete", "resumable_start",
                       "resumable_chunk", "stage_block", "commit_block_list"})
"""The object stores' requests that write (the ``op`` of their request counters): a refusal of one of
these (403, a quota) means the store cannot be written, :class:`StoreUnwritable`."""

UNWRITABLE_ADVICE = "free space in it (or make it writable), or point store.uri at a store that can be written"
"""What to do about a store that cannot be written: the end of every line that says so."""


def refused_write(service: str, op: str, uri: str, code: Any) -> StoreUnwritable:
    """The error of an object store's write refused for good (``code``: its error code or HTTP status)."""
    return StoreUnwritable(f"{service} refused {op} on {uri}: {code}: the store cannot be written (read-only "
                           f"credentials, a bucket policy or a quota); {UNWRITABLE_ADVICE}")


def probe_writable(store: "Store") -> None:
    """Write and delete one small key at the store's root: a store that cannot be written (full,
    read-only, a directory without write permission, an object store that refuses the write) is
    refused here, in one line, before anything else is written.

    Raises:
        StoreUnwritable: the write was refused (exit 2).
    """
    key = f".relaunch-write-probe-{secrets.token_hex(6)}.tmp"
    try:
        store.write_bytes(key, b"relaunch write probe\n")
    except OSError as err:
        if not isinstance(err, PermissionError) and err.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
            raise
        why = {errno.ENOSPC: "it is full", errno.EDQUOT: "its quota is used up", errno.EROFS: "it is read-only"}.get(
            err.errno, "permission denied")
        raise StoreUnwritable(f"store {store.uri} cannot be written ({why}: {err.strerror or err}); "
                              f"{UNWRITABLE_ADVICE}") from None
    try:
        store.delete(key)
    except (OSError, BadInput):
        pass  # a store that takes writes but not deletions: retention will say so


class HintWrites:
    """``store`` for records that are hints, brought up to date by their next write (an attempt's
    heartbeat record, the metric points buffered at a checkpoint): a write refused because the store
    cannot be written (full, read-only) is skipped and counted in ``skipped``, so that such a store
    does not end the training on the one rank that keeps these records; the checkpoints, which every
    rank saves together, decide what a store that stays unwritable means. Anything else is ``store``'s."""

    def __init__(self, store: "Store"):
        self._store = store
        self.skipped = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def write_bytes(self, key: str, data: bytes, *, if_match: str | None = None) -> str | None:
        try:
            return self._store.write_bytes(key, data, if_match=if_match)
        except (OSError, StoreUnwritable) as err:
            if not is_store_unwritable(err):
                raise
            self.skipped += 1
            return None


def open_store(uri: str, *, retries: int | None = None, backoff: float | None = None) -> Store:
    """Open the store at ``uri``: a path, ``file:///path``, ``s3://bucket/prefix`` or a URI of
    another registered backend.

    The S3 backend is checked with one cheap request (bucket exists, credentials accepted), once per
    process for the same endpoint, bucket and credentials.

    Raises:
        BadInput: malformed URI, unsupported scheme, missing bucket, rejected credentials.
        TransientFailure: the endpoint could not be reached after the bounded retries.
    """
    try:
        scheme, location, prefix = parse_store_uri(uri)
    except ValueError as err:
        raise BadInput(str(err)) from None
    options = {k: v for k, v in (("retries", retries), ("backoff", backoff)) if v is not None}
    return BACKENDS[scheme].open(location, prefix, **options)


# -- helpers the backends share


def byte_view(buffer: Any) -> memoryview:
    """A flat unsigned-byte view of any buffer (a tensor's, an array's)."""
    view = memoryview(buffer)
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


class Segments:
    """Writable buffers filled one after another as if they were one (a vectored read's target)."""

    def __init__(self, buffer: Any):
        parts = buffer if isinstance(buffer, (list, tuple)) else [buffer]
        self.views = [v for v in (byte_view(b) for b in parts) if len(v)]
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


def join_uri(root: str, key: str) -> str:
    """``root/key`` (``root`` itself for the empty key)."""
    return f"{root.rstrip('/')}/{key.lstrip('/')}" if key else root


def check_key(key: str) -> str:
    """``key`` if it is relative without ``.`` or ``..`` parts, else BadInput."""
    if key.startswith("/") or any(part in ("..", ".") for part in key.split("/")):
        raise BadInput(f"store key {key!r} must be relative and must not contain '.' or '..' parts")
    return key


# -- the backends: one line each (importing the module registers its class)
from .file import FileStore  # noqa: E402
from .object_store import ObjectDriver, ObjectStore  # noqa: E402 - the object stores' core
from .s3 import S3Driver  # noqa: E402
from .gcs import GCSDriver  # noqa: E402
from .azure import AzureDriver  # noqa: E402

__all__ = ["BACKENDS", "Backend", "AzureDriver", "FileStore", "GCSDriver", "ObjectDriver", "ObjectStore", "PreconditionFailed",
           "READ_BLOCK", "S3Driver", "Segments", "Store",
           "StreamWriter", "HintWrites", "UNWRITABLE_ADVICE", "WRITE_OPS", "byte_view", "check_key", "join_uri", "open_store",
           "parse_store_uri", "probe_writable", "refused_write", "register_backend"]
