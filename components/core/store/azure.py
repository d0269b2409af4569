"""The Azure Blob backend, ``az://container/prefix``, through the official ``azure-storage-blob``.

Credentials and endpoint from the environment only, with the names the Azure SDKs and the ``az`` CLI
use: ``AZURE_STORAGE_CONNECTION_STRING`` (its ``BlobEndpoint`` points at Azurite or another
endpoint; ``AccountKey`` or ``SharedAccessSignature`` inside it), else ``AZURE_STORAGE_ACCOUNT`` with
``AZURE_STORAGE_KEY`` (account key) or ``AZURE_STORAGE_SAS_TOKEN`` (a SAS), at
``https://<account>.blob.core.windows.net`` unless ``AZURE_STORAGE_BLOB_ENDPOINT`` says otherwise.

Pointers and leases are conditional writes on ETags (``If-None-Match: *`` to create, ``If-Match``
to replace). Large objects go up as staged blocks (Put Block, then Put Block List); the blocks of a
writer killed before its Put Block List stay uncommitted, invisible to readers, until Azure
garbage-collects them after 7 days; ``abort_incomplete_uploads`` drops them at once. The SDK's own
retries are off: transient failures (connection errors, timeouts, 408, 429, 5xx) are retried here
with exponential backoff and full jitter, then :class:`TransientFailure` (exit 138); rejected
credentials, a missing container, a malformed URI are :class:`BadInput` (exit 2) at once.
Retry tuning as for S3: ``RELAUNCH_STORE_RETRIES``, ``RELAUNCH_STORE_BACKOFF``.
"""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import hashlib
import os
import re
from pathlib import Path
from typing import Any, Callable, Iterable, TypeVar

from components.core.contract.errors import BadInput, TransientFailure
from components.core.store import (READ_BLOCK, WRITE_OPS, PreconditionFailed, Requests, Segments, StreamWriter,
                                   byte_view, join_uri, refused_write, register_backend)

T = TypeVar("T")

SINGLE_PUT_LIMIT = 64 * 1024 * 1024  # the SDK's own splitting of one upload_blob call (ours stay below a block)
BLOCK_SIZE = 32 * 1024 * 1024
PARALLEL_BLOCKS = 4
_CONTAINER = re.compile(r"^(?=.{3,63}$)[a-z0-9](?:[a-z0-9]|-(?!-))*[a-z0-9]$")
_CREDENTIAL_CODES = frozenset({"AuthenticationFailed", "AuthorizationFailure", "AuthorizationPermissionMismatch",
                               "InvalidAuthenticationInfo", "AuthorizationSourceIPMismatch",
                               "AuthorizationProtocolMismatch", "AuthorizationResourceTypeMismatch",
                               "AuthorizationServiceMismatch", "NoAuthenticationInformation"})


def _env(*names: str) -> str | None:
    for name in names:
        if os.environ.get(name):
            return os.environ[name]
    return None


def azure_settings() -> dict[str, str]:
    """Which credential the environment gives: ``{"connection_string": ...}`` or
    ``{"account_url": ..., "credential": ...}``.

    Raises:
        BadInput: none is set, or an account without a key or SAS.
    """
    conn = _env("AZURE_STORAGE_CONNECTION_STRING")
    if conn:
        return {"connection_string": conn}
    account = _env("AZURE_STORAGE_ACCOUNT", "AZURE_STORAGE_ACCOUNT_NAME")
    if not account:
        raise BadInput("az:// store needs credentials: set AZURE_STORAGE_CONNECTION_STRING, or AZURE_STORAGE_ACCOUNT "
                       "with AZURE_STORAGE_KEY or AZURE_STORAGE_SAS_TOKEN")
    credential = _env("AZURE_STORAGE_KEY", "AZURE_STORAGE_SAS_TOKEN")
    if not credential:
        raise BadInput(f"AZURE_STORAGE_ACCOUNT={account} needs AZURE_STORAGE_KEY or AZURE_STORAGE_SAS_TOKEN")
    url = _env("AZURE_STORAGE_BLOB_ENDPOINT") or f"https://{account}.blob.core.windows.net"
    if not os.environ.get("AZURE_STORAGE_KEY"):
        return {"account_url": url.rstrip("/") + "?" + credential.lstrip("?"), "credential": ""}
    return {"account_url": url, "credential": {"account_name": account, "account_key": credential}}


def wasbs_uri(uri: str) -> str:
    """``az://container/prefix`` as MLflow (its dataset sources) and Hadoop name the same blobs:
    ``wasbs://container@<account>.blob.core.windows.net/prefix``, the account from the environment's
    credentials (``account`` when none names one). No I/O."""
    container, _, prefix = uri.split("://", 1)[1].partition("/")
    parts = (_env("AZURE_STORAGE_CONNECTION_STRING") or "").split(";")
    conn = dict(part.split("=", 1) for part in parts if "=" in part)
    account = conn.get("AccountName") or _env("AZURE_STORAGE_ACCOUNT", "AZURE_STORAGE_ACCOUNT_NAME") or "account"
    return f"wasbs://{container}@{account}.blob.core.windows.net/{prefix}".rstrip("/")


_CHECKED: set[tuple] = set()
"""(credentials digest, container) one request of this process already proved."""


@register_backend
class AzureStore(Requests):
    """An Azure Blob container/prefix through ``azure-storage-blob``, with bounded retries."""

    scheme = "az"
    example = "az://container/prefix"

    @classmethod
    def parse(cls, uri: str) -> tuple[str, str]:
        """``(container, prefix)`` of ``az://container/prefix``.

        Raises:
            ValueError: no container, an invalid container name, credentials in the URI, '.' or '..' parts.
        """
        container, _, prefix = uri.split("://", 1)[1].partition("/")
        if not container:
            raise ValueError(f"az URI {uri!r} has no container; write az://container/prefix")
        if "@" in container or ":" in container:
            raise ValueError("az URI must not carry an account or credentials; set AZURE_STORAGE_CONNECTION_STRING")
        if not _CONTAINER.match(container):
            raise ValueError(f"az container name {container!r} is invalid (3-63 lowercase letters, digits and "
                             f"single '-', starting and ending with a letter or digit)")
        if any(p in ("..", ".") for p in prefix.split("/")):
            raise ValueError(f"az URI {uri!r} must not contain '.' or '..' path parts")
        return container, prefix

    @classmethod
    def open(cls, location: str, prefix: str, *, retries: int | None = None,
             backoff: float | None = None) -> "AzureStore":
        """The store at ``container`` (``location``) and ``prefix``, checked with one request
        (container exists, credentials accepted) once per process per credentials and container.

        Raises:
            BadInput: no or rejected credentials, missing container.
            TransientFailure: the endpoint could not be reached after the bounded retries.
        """
        store = cls(location, prefix, retries=retries, backoff=backoff)
        proof = (hashlib.sha256(repr(sorted(azure_settings().items())).encode()).hexdigest(), location)
        if proof not in _CHECKED:
            store.check()
            _CHECKED.add(proof)
        return store

    def __init__(self, container: str, prefix: str, *, retries: int | None = None, backoff: float | None = None):
        from azure.storage.blob import BlobServiceClient

        self.container_name, self.prefix = container, prefix.strip("/")
        self.uri = f"az://{container}/{self.prefix}".rstrip("/")
        self._init_requests(retries, backoff)
        s = azure_settings()
        options = {"retry_total": 0, "connection_timeout": 10, "read_timeout": 60,
                   "max_single_put_size": SINGLE_PUT_LIMIT, "max_block_size": BLOCK_SIZE}
        try:
            if "connection_string" in s:
                service = BlobServiceClient.from_connection_string(s["connection_string"], **options)
            else:
                service = BlobServiceClient(s["account_url"], credential=s["credential"] or None, **options)
        except ValueError as err:
            raise BadInput(f"AZURE_STORAGE_CONNECTION_STRING (or account settings) is malformed: {err}") from None
        self.endpoint = service.url.split("?")[0].rstrip("/")
        self.container = service.get_container_client(container)

    # -- plumbing
    def _blob(self, key: str) -> Any:
        return self.container.get_blob_client(self._name(key))

    def _call(self, op: str, fn: Callable[[], T], *, key: str = "") -> T:
        """Run one request with bounded retries of transient failures; map permanent ones."""
        from azure.core.exceptions import (HttpResponseError, IncompleteReadError, ServiceRequestError,
                                           ServiceResponseError)

        delay = self.backoff
        for attempt in range(1, self.retries + 1):
            self._count(op)
            try:
                return fn()
            except (ServiceRequestError, ServiceResponseError, IncompleteReadError, ConnectionError,
                    TimeoutError) as err:  # no answer, or a body cut short: the connection broke
                last: BaseException = err
            except HttpResponseError as err:
                last = err
                if err.status_code is not None:  # None: an answer cut short or undecodable in flight
                    self._raise_permanent(err, op, key)
            if attempt == self.retries:
                break
            delay = self._back_off(delay)
        raise TransientFailure(f"Azure {op} {self.uri_for(key)} failed {self.retries} times; last error: "
                               f"{type(last).__name__}: {str(last).splitlines()[0][:200] if str(last) else ''}")

    def _raise_permanent(self, err: Any, op: str, key: str) -> None:
        """Raise what an answered failure means unless it is transient (408, 429, 5xx): then return."""
        from azure.core.exceptions import (ClientAuthenticationError, ResourceExistsError, ResourceModifiedError,
                                           ResourceNotFoundError)

        code, status = str(getattr(err.error_code, "value", err.error_code) or ""), err.status_code or 0
        if code == "ContainerNotFound":
            raise BadInput(f"container {self.container_name!r} does not exist at {self.endpoint}; "
                           f"create it or fix the store URI") from None
        if op in WRITE_OPS and status == 403:
            raise refused_write("Azure", op, self.uri_for(key), code or status) from None
        if isinstance(err, ClientAuthenticationError) or code in _CREDENTIAL_CODES or status in (401, 403):
            raise BadInput(f"Azure refused {op} on {self.uri_for(key)}: {code or status} (check "
                           f"AZURE_STORAGE_CONNECTION_STRING / AZURE_STORAGE_KEY / the SAS)") from None
        if isinstance(err, ResourceNotFoundError) or status == 404:
            raise FileNotFoundError(self.uri_for(key)) from None
        if code == "InvalidRange" or status == 416:
            raise EOFError(f"{self.uri_for(key)} is shorter than the range asked for") from None
        if isinstance(err, (ResourceModifiedError, ResourceExistsError)) or status in (409, 412):
            raise PreconditionFailed(f"{self.uri_for(key)} exists or changed since it was read "
                                     f"(another writer?)") from None
        if status < 500 and status not in (408, 429):
            raise BadInput(f"Azure error on {op} {self.uri_for(key)}: {code or status}: "
                           f"{str(err.message or err)[:200]}") from None

    # -- the interface
    def check(self) -> None:
        """One cheap request that proves endpoint, credentials and container."""
        self._call("container_properties", self.container.get_container_properties)

    def read_bytes(self, key: str) -> bytes:
        blob = self._blob(key)
        data = self._call("get", lambda: blob.download_blob(max_concurrency=1).readall(), key=key)
        self._add_bytes("bytes_read", len(data))
        return data

    def read_into(self, key: str, offset: int, buffer: Any, *, sink: Callable[[int], None] | None = None) -> None:
        """One ranged download (the SDK's: a first GET of up to 32 MiB, then 4 MiB GETs) of the bytes that
        fill ``buffer`` (a writable buffer or a list of them) from ``offset``, each chunk copied into
        the buffers as it arrives, with ``sink(bytes filled so far)`` every READ_BLOCK (a retried
        request starts over at ``sink(0)``). FileNotFoundError if absent; EOFError if short."""
        segments = Segments(buffer)
        total = segments.total
        if not total:
            return
        blob = self._blob(key)

        def get() -> int:
            if sink is not None:
                sink(0)
            done, reported = 0, 0
            for chunk in blob.download_blob(offset=offset, length=total, max_concurrency=1).chunks():
                view = memoryview(chunk)[:total - done]
                pos = 0
                for piece in segments.slices(done, len(view)):
                    piece[:] = view[pos:pos + len(piece)]
                    pos += len(piece)
                done += pos
                if sink is not None and (done - reported >= READ_BLOCK or done == total):
                    sink(done)
                    reported = done
                if done >= total:
                    break
            return done

        done = self._call("get_range", get, key=key)
        if done < total:
            raise EOFError(f"{self.uri_for(key)} ends {total - done} bytes before the range asked for")
        self._add_bytes("bytes_read", done)

    def open_writer(self, key: str) -> StreamWriter:
        """Stream ``key`` up: one Put Blob when it stays below one block, else staged blocks that go
        up in parallel while the caller writes on, committed by ``close()``."""
        self._count("open_writer")
        return _BlockWriter(self, key)

    def sizes(self, prefix: str) -> dict[str, int]:
        """``{key: size}`` of the blobs directly under ``prefix`` (one listing)."""
        full = self._name(prefix.rstrip("/")) + "/"
        strip = len(self.prefix) + 1 if self.prefix else 0

        def listing() -> dict[str, int]:
            return {b.name[strip:]: int(b.size or 0) for b in self.container.walk_blobs(full, delimiter="/")
                    if not b.name.endswith("/") and hasattr(b, "size")}

        return self._call("list", listing, key=prefix)

    def _put(self, key: str, data: bytes, op: str = "put", **conditions: Any) -> tuple[dict, int]:
        blob, attempts = self._blob(key), [0]

        def put() -> dict:
            attempts[0] += 1
            return blob.upload_blob(data, blob_type="BlockBlob", length=len(data), max_concurrency=1, **conditions)

        try:
            result = self._call(op, put, key=key)
        except PreconditionFailed as err:
            err.attempts = attempts[0]  # type: ignore[attr-defined]
            raise
        self._add_bytes("bytes_written", len(data))
        return result, attempts[0]

    def _holds(self, key: str, data: bytes) -> bool:
        try:
            return self.read_bytes(key) == data
        except FileNotFoundError:
            return False

    def write_bytes(self, key: str, data: bytes, *, if_match: str | None = None) -> str | None:
        """Put ``key``; with ``if_match`` only if its ETag is still that one (``If-Match``), else
        PreconditionFailed (also when the key is gone). Returns the new ETag. A retried conditional
        put whose first attempt landed is answered 412: the key is read back, and holding our
        bytes it is ours."""
        from azure.core import MatchConditions

        if if_match is None:
            return self._put(key, data, overwrite=True)[0].get("etag")
        try:
            result, _ = self._put(key, data, overwrite=True, etag=if_match,
                                  match_condition=MatchConditions.IfNotModified)
        except FileNotFoundError:
            raise PreconditionFailed(f"{self.uri_for(key)} is gone since it was read (another writer?)") from None
        except PreconditionFailed as err:
            if getattr(err, "attempts", 1) > 1 and self._holds(key, data):
                self._count("conditional_read_back")
                return self.etag(key)
            raise
        return result.get("etag")

    def write_if_absent(self, key: str, data: bytes) -> bool:
        """Create ``key`` only if absent (``If-None-Match: *``); False if it exists (a retried
        request whose first attempt landed counts as created when the key holds our bytes)."""
        try:
            self._put(key, data, overwrite=False)
            return True
        except PreconditionFailed as err:
            if getattr(err, "attempts", 1) > 1 and self._holds(key, data):
                self._count("conditional_read_back")
                return True
            return False

    def upload_file(self, key: str, path: str | os.PathLike) -> None:
        """One Put Blob below 64 MiB, else 32 MiB blocks staged in parallel, each retried on its own."""
        with open(path, "rb") as fh, _BlockWriter(self, key) as w:
            while chunk := fh.read(BLOCK_SIZE):
                w.write(chunk)

    def download_file(self, key: str, path: str | os.PathLike) -> None:
        blob, path = self._blob(key), Path(path)
        tmp = path.with_name(f".{path.name}.download")

        def get() -> None:
            with open(tmp, "wb") as fh:
                blob.download_blob(max_concurrency=PARALLEL_BLOCKS).readinto(fh)

        self._call("get", get, key=key)
        os.replace(tmp, path)

    def exists(self, key: str) -> bool:
        return self.etag(key) is not None

    def etag(self, key: str) -> str | None:
        blob = self._blob(key)
        try:
            return self._call("stat", blob.get_blob_properties, key=key).etag
        except FileNotFoundError:
            return None

    def list(self, prefix: str = "", recursive: bool = True) -> list[str]:
        """Keys under ``prefix`` relative to the root; non-recursive gives sub-"directories" with ``/``."""
        full = self._name(prefix) if prefix else (self.prefix + "/" if self.prefix else "")
        if full and not full.endswith("/"):
            full += "/"
        strip = len(self.prefix) + 1 if self.prefix else 0

        def listing() -> list[str]:
            if recursive:
                return [b.name[strip:] for b in self.container.list_blobs(name_starts_with=full or None)]
            return [b.name[strip:] for b in self.container.walk_blobs(full or None, delimiter="/")]

        return sorted(self._call("list", listing, key=prefix))

    def delete(self, key: str) -> None:
        """Delete ``key``; a missing key is no error (as on S3)."""
        blob = self._blob(key)
        try:
            self._call("delete", blob.delete_blob, key=key)
        except FileNotFoundError:
            pass

    def delete_many(self, keys: Iterable[str]) -> None:
        """One Delete Blob per key, a few in parallel (a missing key is no error)."""
        with concurrent.futures.ThreadPoolExecutor(PARALLEL_BLOCKS) as pool:
            list(pool.map(self.delete, list(keys)))

    def abort_incomplete_uploads(self, prefix: str) -> int:
        """Drop the uncommitted blocks of blobs never committed under the directory ``prefix`` (all
        of the store with ``""``): what a writer killed between Put Block and Put Block List left.
        Azure has no abort call: an empty block list is committed (``If-None-Match: *``, so a blob
        committed meanwhile is never touched), which discards the blocks, then the empty blob is
        deleted. Returns how many such blobs were found and are gone now. Call it while holding the
        write lease, before this writer's first upload: it would drop a live writer's blocks too.

        Raises:
            TransientFailure: a request still failed after the bounded retries (exit 138).
        """
        if prefix.strip("/"):
            full = self._name(prefix.strip("/")) + "/"
        else:
            full = self.prefix + "/" if self.prefix else ""
        strip = len(self.prefix) + 1 if self.prefix else 0

        def listing() -> tuple[set[str], set[str]]:
            start = full or None
            every = {b.name for b in self.container.list_blobs(name_starts_with=start, include=["uncommittedblobs"])}
            committed = {b.name for b in self.container.list_blobs(name_starts_with=start)}
            return every, committed

        every, committed = self._call("uncommitted_list", listing, key=prefix)
        gone = 0
        for name in sorted(every - committed):
            blob, key = self.container.get_blob_client(name), name[strip:]
            try:
                self._call("uncommitted_drop", lambda b=blob: b.commit_block_list([], if_none_match="*"), key=key)
            except PreconditionFailed:  # committed meanwhile by someone: not ours to drop
                continue
            try:
                self._call("delete", blob.delete_blob, key=key)
            except FileNotFoundError:
                pass
            gone += 1
        return gone

    def _drop_once(self, blob: Any) -> None:
        """Best effort, on a failure path: drop a never-committed blob's blocks (one try each); what
        this leaves, the next writer's ``abort_incomplete_uploads`` drops."""
        with contextlib.suppress(Exception):
            self._count("uncommitted_drop")
            blob.commit_block_list([], if_none_match="*")
            self._count("delete")
            blob.delete_blob()

    def uri_for(self, key: str) -> str:
        return join_uri(self.uri, key)


class _BlockWriter:
    """Buffers up to one block; a blob that stays below it is one Put Blob, a larger one is staged
    blocks (at most PARALLEL_BLOCKS in flight) committed by ``close()``."""

    def __init__(self, store: AzureStore, key: str):
        self.store, self.key, self.blob = store, key, store._blob(key)
        self.buf = bytearray()
        self.blocks: list[concurrent.futures.Future] = []
        self.pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.closed = False

    def __enter__(self) -> "_BlockWriter":
        return self

    def __exit__(self, kind: Any, *_: Any) -> None:
        if kind is None:
            self.close()
        else:
            self.abort()

    def write(self, data: Any) -> None:
        view = byte_view(data)
        while len(view):
            take = min(BLOCK_SIZE - len(self.buf), len(view))
            self.buf += view[:take]
            view = view[take:]
            if len(self.buf) >= BLOCK_SIZE:
                self._stage()

    def _stage(self) -> None:
        store, chunk, self.buf = self.store, bytes(self.buf), bytearray()
        if self.pool is None:
            self.pool = concurrent.futures.ThreadPoolExecutor(PARALLEL_BLOCKS)
        in_flight = [f for f in self.blocks if not f.done()]
        if len(in_flight) >= PARALLEL_BLOCKS:  # bounded memory: wait for one to finish
            concurrent.futures.wait(in_flight, return_when=concurrent.futures.FIRST_COMPLETED)
        for f in self.blocks:
            if f.done() and f.exception() is not None:
                raise f.exception()
        # Block ids must all have the same length within a blob: a fixed-width number.
        block_id = base64.b64encode(f"relaunch-{len(self.blocks):08d}".encode()).decode()

        def put() -> str:
            store._call("stage_block", lambda: self.blob.stage_block(block_id, chunk, length=len(chunk)),
                        key=self.key)
            store._add_bytes("bytes_written", len(chunk))
            return block_id

        self.blocks.append(self.pool.submit(put))

    def close(self) -> None:
        if self.closed:
            return
        store = self.store
        try:
            if not self.blocks:
                store._put(self.key, bytes(self.buf), overwrite=True)
            else:
                if self.buf:
                    self._stage()
                ids = [f.result() for f in self.blocks]
                from azure.storage.blob import BlobBlock

                store._call("commit_block_list", lambda: self.blob.commit_block_list([BlobBlock(i) for i in ids]),
                            key=self.key)
        except BaseException:
            self.abort()
            raise
        finally:
            if self.pool is not None:
                self.pool.shutdown(wait=True)
        self.closed = True

    def abort(self) -> None:
        """Stop staging; the staged blocks stay uncommitted (never visible) until the next writer's
        ``abort_incomplete_uploads`` or Azure's 7-day collection drops them."""
        self.closed = True
        self.buf = bytearray()
        if self.pool is not None:
            for f in self.blocks:
                f.cancel()
            self.pool.shutdown(wait=True)
        if self.blocks:
            self.store._drop_once(self.blob)
