"""The S3 backend: any S3-compatible server through the ``minio`` client, ``s3://bucket/prefix``.

Large files go up in parallel multipart parts; transient failures (connection reset, timeout, 5xx,
SlowDown) are retried with exponential backoff and full jitter, a bounded number of times, before
:class:`TransientFailure` (exit 138). Permanent failures (403, NoSuchBucket, bad credentials,
malformed URI) raise :class:`BadInput` (exit 2) at once.

S3 configuration, from the environment only (never from arguments that end up in logs):
``AWS_ENDPOINT_URL`` (``http(s)://host:port``; TLS from the scheme), ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_REGION``/``AWS_DEFAULT_REGION``; or the MinIO
equivalents ``MINIO_ENDPOINT`` (``host:port`` or a URL), ``MINIO_ACCESS_KEY``, ``MINIO_SECRET_KEY``,
``MINIO_SECURE`` (``true``/``false``), ``MINIO_REGION``. Retry tuning: ``RELAUNCH_STORE_RETRIES``
(attempts, default 8) and ``RELAUNCH_STORE_BACKOFF`` (first backoff in seconds, default 0.1).

The minio and urllib3 private calls this module needs (conditional PUTs, per-part retried
multipart uploads, ListMultipartUploads, reads from the socket into our buffers) all go through
:class:`_MinioCalls` at the end of this file, whose recorded signatures a test checks.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import os
import urllib.parse
from pathlib import Path
from typing import Any, Callable, Iterable, TypeVar

from components.core.contract.classify import S3_CREDENTIAL_CODES, S3_TRANSIENT_CODES
from components.core.contract.errors import BadInput, TransientFailure
from components.core.store import (READ_BLOCK, WRITE_OPS, PreconditionFailed, Requests, Segments, StreamWriter,
                                   byte_view, join_uri, refused_write, register_backend)

T = TypeVar("T")

S3_REFUSED_WRITE_CODES = frozenset({"AccessDenied", "QuotaExceeded", "XMinioStorageFull",
                                    "XMinioAdminBucketQuotaExceeded", "XMinioBucketQuotaExceeded"})
"""S3 error codes of a write refused for good (read-only credentials or policy, a full disk or bucket
quota): the store cannot be written (:class:`~components.core.contract.errors.StoreUnwritable`)."""

MULTIPART_THRESHOLD = 64 * 1024 * 1024
PART_SIZE = 32 * 1024 * 1024
PARALLEL_PARTS = 4


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


_CHECKED_BUCKETS: set[tuple] = set()
"""(endpoint, bucket, credentials) one request of this process already proved: opening the same
store again (every step opens it a few times) costs no further request."""


@register_backend
class S3Store(Requests):
    """An S3-compatible bucket/prefix through ``minio``, with bounded retries of transient errors."""

    scheme = "s3"
    example = "s3://bucket/prefix"

    @classmethod
    def parse(cls, uri: str) -> tuple[str, str]:
        """``(bucket, prefix)`` of ``s3://bucket/prefix``.

        Raises:
            ValueError: no bucket, an invalid bucket name, credentials or a port in the URI, '.' or
                '..' parts in the prefix.
        """
        bucket, _, prefix = uri.split("://", 1)[1].partition("/")
        if not bucket:
            raise ValueError(f"s3 URI {uri!r} has no bucket; write s3://bucket/prefix")
        if "@" in bucket or ":" in bucket:
            raise ValueError("s3 URI must not carry credentials or a port; set AWS_ENDPOINT_URL and "
                             "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY")
        if len(bucket) < 3 or len(bucket) > 63 or not all(c.islower() or c.isdigit() or c in "-." for c in bucket):
            raise ValueError(f"s3 bucket name {bucket!r} is invalid (3-63 lowercase letters, digits, '-', '.')")
        if any(p in ("..", ".") for p in prefix.split("/")):
            raise ValueError(f"s3 URI {uri!r} must not contain '.' or '..' path parts")
        return bucket, prefix

    @classmethod
    def open(cls, location: str, prefix: str, *, retries: int | None = None,
             backoff: float | None = None) -> "S3Store":
        """The store at ``bucket`` (``location``) and ``prefix``, checked with one cheap request
        (bucket exists, credentials accepted) once per process for the same endpoint, bucket and
        credentials.

        Raises:
            BadInput: no endpoint, incomplete or rejected credentials, missing bucket.
            TransientFailure: the endpoint could not be reached after the bounded retries.
        """
        store = cls(location, prefix, retries=retries, backoff=backoff)
        settings = _s3_settings()
        secret = f"{settings['secret_key']}|{settings['session_token']}"
        proof = (settings["endpoint"], settings["secure"], location, settings["access_key"],
                 hashlib.sha256(secret.encode()).hexdigest())
        if proof not in _CHECKED_BUCKETS:
            store.check()
            _CHECKED_BUCKETS.add(proof)
        return store

    def __init__(self, bucket: str, prefix: str, *, retries: int | None = None, backoff: float | None = None):
        import urllib3
        from minio import Minio

        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.uri = f"s3://{bucket}/{self.prefix}".rstrip("/")
        self._init_requests(retries, backoff)
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
                if op in WRITE_OPS and err.code in S3_REFUSED_WRITE_CODES:
                    raise refused_write("S3", op, self.uri_for(key), err.code) from None
                if err.code in S3_CREDENTIAL_CODES:
                    raise BadInput(f"S3 refused {op} on {self.uri_for(key)}: {err.code} (check "
                                   f"AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY and the bucket policy)") from None
                if err.code == "PreconditionFailed":
                    raise PreconditionFailed(f"{self.uri_for(key)} exists or changed since it was read "
                                             f"(another writer?)") from None
                status = getattr(err.response, "status", 0) or 0
                if err.code not in S3_TRANSIENT_CODES and status < 500:
                    raise BadInput(f"S3 error on {op} {self.uri_for(key)}: {err.code}: {err.message}") from None
                last: BaseException = err
            except Exception as err:  # noqa: BLE001 - classified just below
                if not _is_transient(err):
                    raise
                last = err
            if attempt == self.retries:
                break
            delay = self._back_off(delay)
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
        segments = Segments(buffer)
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
        return join_uri(self.uri, key)


class _MultipartWriter:
    def __init__(self, store: S3Store, key: str):
        self.store, self.key, self.name = store, key, store._name(key)
        self.buf = bytearray()
        self.upload_id: str | None = None
        self.parts: list[concurrent.futures.Future] = []
        self.pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.closed = False

    def write(self, data: Any) -> None:
        view = byte_view(data)
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
