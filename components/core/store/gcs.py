"""The Google Cloud Storage backend, ``gs://bucket/prefix``, through the official ``google-cloud-storage``
client (and its ``google-auth`` session for ranged reads and resumable uploads).

Conditional writes use generation preconditions: ``ifGenerationMatch=0`` creates only
(``write_if_absent``), the generation read before (``etag``) replaces only that version
(``write_bytes(if_match=...)``); a refused one is :class:`PreconditionFailed`. An object that goes up
in one request goes as a multipart upload (GCS evaluates preconditions on every upload,
fake-gcs-server, the emulator of the tests, on multipart ones only). Ranged reads go from the socket
into the caller's buffers. Objects above one chunk go up as resumable uploads, one chunk at a
time, each chunk retried on its own (the server says how much it has; the upload resumes there).
Transient failures (connection errors, timeouts, 429, 5xx) are retried with exponential backoff and
full jitter, a bounded number of times, before :class:`TransientFailure` (exit 138); refused
credentials, a missing bucket and other 4xx answers raise :class:`BadInput` (exit 2) at once.

Configuration, from the environment only, as the official client reads it:
``STORAGE_EMULATOR_HOST`` (``host:port`` or a URL; then no credentials are sent, as the official client
does for emulators); otherwise Application Default Credentials: ``GOOGLE_APPLICATION_CREDENTIALS``
(a key file, e.g. mounted from a Kubernetes Secret) or workload identity (the metadata server).
``GOOGLE_CLOUD_PROJECT`` is optional. Retry tuning: ``RELAUNCH_STORE_RETRIES`` (attempts, default 8) and
``RELAUNCH_STORE_BACKOFF`` (first backoff in seconds, default 0.1).

Uploads a killed writer left: GCS has no listing of open resumable sessions (S3 has
ListMultipartUploads). A writer that aborts cancels its own session (``DELETE`` on the session URI); a
session whose writer was killed holds no object, is never billed, and expires a week after it was
opened. So :meth:`GCSStore.abort_incomplete_uploads` has nothing to find and returns 0.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import urllib.parse
from pathlib import Path
from typing import Any, Callable, Iterable, TypeVar

from components.core.contract.errors import BadInput, TransientFailure
from components.core.store import (READ_BLOCK, WRITE_OPS, PreconditionFailed, Requests, Segments, StreamWriter,
                                   byte_view, join_uri, refused_write, register_backend)

T = TypeVar("T")

CHUNK_SIZE = 16 * 1024 * 1024
"""Resumable upload chunk (a multiple of 256 KiB, as GCS requires); smaller objects go up in one request."""
GCS_ENDPOINT = "https://storage.googleapis.com"
SCOPES = ("https://www.googleapis.com/auth/devstorage.read_write",)
_BUCKET = re.compile(r"[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]")

_CHECKED_BUCKETS: set[tuple] = set()
"""(endpoint, bucket, credentials) one request of this process already proved."""


def _settings() -> tuple[str, Any, str]:
    """``(endpoint, credentials, project)`` from the environment.

    Raises:
        BadInput: no credentials could be found (GOOGLE_APPLICATION_CREDENTIALS unset or unreadable
            and no metadata server).
    """
    emulator = os.environ.get("STORAGE_EMULATOR_HOST", "").strip()
    project = os.environ.get("GOOGLE_CLOUD_PROJECT") or "<none>"
    if emulator:
        from google.auth.credentials import AnonymousCredentials

        endpoint = emulator if "://" in emulator else f"http://{emulator}"
        parsed = urllib.parse.urlparse(endpoint)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise BadInput(f"STORAGE_EMULATOR_HOST {emulator!r} is not host:port or http(s)://host:port")
        return endpoint.rstrip("/"), AnonymousCredentials(), project
    import google.auth
    from google.auth.exceptions import DefaultCredentialsError

    try:
        credentials, found = google.auth.default(scopes=list(SCOPES))
    except DefaultCredentialsError as err:
        first = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
        raise BadInput(f"gs:// store has no usable credentials ({first}); set GOOGLE_APPLICATION_CREDENTIALS to "
                       f"a service-account key file, use workload identity, or set STORAGE_EMULATOR_HOST "
                       f"for an emulator") from None
    return GCS_ENDPOINT, credentials, (os.environ.get("GOOGLE_CLOUD_PROJECT") or found or "<none>")


@register_backend
class GCSStore(Requests):
    """A GCS bucket/prefix, with generation preconditions and bounded retries of transient errors."""

    scheme = "gs"
    example = "gs://bucket/prefix"

    @classmethod
    def parse(cls, uri: str) -> tuple[str, str]:
        """``(bucket, prefix)`` of ``gs://bucket/prefix``.

        Raises:
            ValueError: no bucket, an invalid bucket name, '.' or '..' parts in the prefix.
        """
        bucket, _, prefix = uri.split("://", 1)[1].partition("/")
        if not bucket:
            raise ValueError(f"gs URI {uri!r} has no bucket; write gs://bucket/prefix")
        if "@" in bucket or ":" in bucket:
            raise ValueError("gs URI must not carry credentials or a port; set GOOGLE_APPLICATION_CREDENTIALS "
                             "(or STORAGE_EMULATOR_HOST for an emulator)")
        if not _BUCKET.fullmatch(bucket) or ".." in bucket:
            raise ValueError(f"gs bucket name {bucket!r} is invalid (3-222 lowercase letters, digits, '-', '_', "
                             f"'.'; starting and ending with a letter or digit)")
        if any(p in ("..", ".") for p in prefix.split("/")):
            raise ValueError(f"gs URI {uri!r} must not contain '.' or '..' path parts")
        return bucket, prefix

    @classmethod
    def open(cls, location: str, prefix: str, *, retries: int | None = None,
             backoff: float | None = None) -> "GCSStore":
        """The store at ``bucket`` (``location``) and ``prefix``, checked with one request (bucket
        exists, credentials accepted) once per process for the same endpoint, bucket and credentials.

        Raises:
            BadInput: no or rejected credentials, missing bucket.
            TransientFailure: the endpoint could not be reached after the bounded retries.
        """
        store = cls(location, prefix, retries=retries, backoff=backoff)
        proof = (store.endpoint, location, os.environ.get("GOOGLE_APPLICATION_CREDENTIALS", ""))
        if proof not in _CHECKED_BUCKETS:
            store.check()
            _CHECKED_BUCKETS.add(proof)
        return store

    def __init__(self, bucket: str, prefix: str, *, retries: int | None = None, backoff: float | None = None):
        import requests.adapters
        from google.auth.transport.requests import AuthorizedSession
        from google.cloud import storage

        self.bucket_name, self.prefix = bucket, prefix.strip("/")
        self.uri = f"gs://{bucket}/{self.prefix}".rstrip("/")
        self._init_requests(retries, backoff)
        self.endpoint, credentials, project = _settings()
        self.client = storage.Client(project=project, credentials=credentials,
                                     client_options={"api_endpoint": self.endpoint})
        self.bucket = self.client.bucket(bucket)
        self.session = AuthorizedSession(credentials)
        adapter = requests.adapters.HTTPAdapter(pool_connections=4, pool_maxsize=16, max_retries=0)
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)
        self.timeout = (10, 60)

    # -- plumbing
    def _media_url(self, name: str) -> str:
        return (f"{self.endpoint}/download/storage/v1/b/{self.bucket_name}/o/"
                f"{urllib.parse.quote(name, safe='')}?alt=media")

    def _call(self, op: str, fn: Callable[[], T], *, key: str = "", missing: str = "key") -> T:
        """Run one request with bounded retries of transient failures; map permanent ones.
        ``missing``: what a 404 means, ``"key"`` (FileNotFoundError) or ``"bucket"`` (BadInput)."""
        from google.api_core import exceptions as gx
        from google.auth import exceptions as ga

        delay = self.backoff
        for attempt in range(1, self.retries + 1):
            self._count(op)
            try:
                return fn()
            except gx.NotFound:
                if missing == "key" and key:
                    raise FileNotFoundError(self.uri_for(key)) from None
                raise BadInput(f"bucket {self.bucket_name!r} does not exist at {self.endpoint}; create it or fix "
                               f"the store URI") from None
            except gx.PreconditionFailed:
                raise PreconditionFailed(f"{self.uri_for(key)} exists or changed since it was read "
                                         f"(another writer?)") from None
            except gx.RequestRangeNotSatisfiable:
                raise EOFError(f"{self.uri_for(key)} is shorter than the range asked for") from None
            except (gx.Unauthorized, gx.Forbidden, ga.RefreshError, ga.DefaultCredentialsError) as err:
                if op in WRITE_OPS and isinstance(err, gx.Forbidden):
                    raise refused_write("GCS", op, self.uri_for(key), 403) from None
                raise BadInput(f"GCS refused {op} on {self.uri_for(key)}: {type(err).__name__} (check "
                               f"GOOGLE_APPLICATION_CREDENTIALS or the workload identity, and the bucket's "
                               f"IAM policy)") from None
            except gx.RetryError as err:
                raise TransientFailure(f"GCS {op} {self.uri_for(key)}: {str(err)[:200]}") from None
            except (gx.TooManyRequests, gx.ServerError) as err:
                last: BaseException = err
            except gx.GoogleAPICallError as err:
                raise BadInput(f"GCS error on {op} {self.uri_for(key)}: {err.code} {err.message}"[:300]) from None
            except Exception as err:  # noqa: BLE001 - classified just below
                if not _is_transient(err):
                    raise
                last = err
            if attempt == self.retries:
                break
            delay = self._back_off(delay)
        raise TransientFailure(f"GCS {op} {self.uri_for(key)} failed {self.retries} times; last error: "
                               f"{type(last).__name__}: {str(last)[:200]}")

    # -- the interface
    def check(self) -> None:
        """One cheap request that proves endpoint, credentials and bucket."""
        self._call("bucket_get", lambda: self.client.get_bucket(self.bucket_name, retry=None, timeout=self.timeout),
                   missing="bucket")

    def read_bytes(self, key: str) -> bytes:
        blob = self.bucket.blob(self._name(key))
        data = self._call("get", lambda: blob.download_as_bytes(retry=None, timeout=self.timeout), key=key)
        self._add_bytes("bytes_read", len(data))
        return data

    def read_into(self, key: str, offset: int, buffer: Any, *, sink: Callable[[int], None] | None = None) -> None:
        """One ranged GET of the bytes that fill ``buffer`` (a writable buffer, or a list of them
        filled one after another) from ``offset``, read from the socket into the buffers, with
        ``sink(bytes filled so far)`` after each READ_BLOCK (a retried request starts over at
        ``sink(0)``). FileNotFoundError if absent; EOFError if short."""
        segments = Segments(buffer)
        total = segments.total
        if not total:
            return
        url = self._media_url(self._name(key))

        def get() -> int:
            if sink is not None:
                sink(0)
            resp = self.session.get(url, headers={"Range": f"bytes={offset}-{offset + total - 1}",
                                                  "Accept-Encoding": "identity"},
                                    stream=True, timeout=self.timeout)
            try:
                _raise_for(resp)
                if resp.status_code != 206 and offset:
                    raise EOFError(f"{self.uri_for(key)}: the server ignored the range asked for")
                done = 0
                while done < total:
                    for piece in segments.slices(done, min(READ_BLOCK, total - done)):
                        filled = 0
                        while filled < len(piece):
                            n = resp.raw.readinto(piece[filled:])
                            if not n:
                                return done + filled
                            filled += n
                        done += filled
                    if sink is not None:
                        sink(done)
                return done
            finally:
                resp.close()

        done = self._call("get_range", get, key=key)
        if done < total:
            raise EOFError(f"{self.uri_for(key)} ends {total - done} bytes before the range asked for")
        self._add_bytes("bytes_read", done)

    def open_writer(self, key: str) -> StreamWriter:
        """Stream ``key`` up: one request when it stays below CHUNK_SIZE, else a resumable upload
        whose chunks go up as the caller writes (nothing is visible under the key before close)."""
        self._count("open_writer")
        return _ResumableWriter(self, key)

    def sizes(self, prefix: str) -> dict[str, int]:
        """``{key: size}`` of the objects directly under ``prefix`` (one listing)."""
        full = self._name(prefix.rstrip("/")) + "/"
        strip = len(self.prefix) + 1 if self.prefix else 0

        def listing() -> dict[str, int]:
            return {b.name[strip:]: int(b.size or 0) for b in self.client.list_blobs(
                self.bucket_name, prefix=full, delimiter="/", retry=None, timeout=self.timeout)}

        return self._call("list", listing, key=prefix, missing="bucket")

    def _upload(self, key: str, data: bytes, generation: int | None) -> tuple[str, int]:
        """One multipart upload request (retried): the object's name and its bytes in one body;
        returns (the new generation, attempts made).

        Multipart, not media: fake-gcs-server evaluates ``ifGenerationMatch`` on multipart uploads
        only. Our own request, not the client's ``upload_from_string``: that one draws its multipart
        boundary from the global ``random`` module, which would shift the training's python RNG
        stream (and break an exact resume) at every checkpoint."""
        query = {"uploadType": "multipart"}
        if generation is not None:
            query["ifGenerationMatch"] = str(generation)
        url = self._upload_url(query)
        boundary = secrets.token_hex(16)
        body = b"".join([f"--{boundary}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n".encode(),
                         json.dumps({"name": self._name(key)}).encode(),
                         f"\r\n--{boundary}\r\nContent-Type: application/octet-stream\r\n\r\n".encode(), data,
                         f"\r\n--{boundary}--\r\n".encode()])
        attempts = [0]

        def put() -> str:
            attempts[0] += 1
            resp = self.session.post(url, data=body, timeout=self.timeout,
                                     headers={"Content-Type": f"multipart/related; boundary={boundary}"})
            _raise_for(resp)
            return str(resp.json()["generation"])

        try:
            result = self._call("put", put, key=key, missing="bucket")
        except PreconditionFailed as err:
            err.attempts = attempts[0]  # type: ignore[attr-defined]
            raise
        self._add_bytes("bytes_written", len(data))
        return result, attempts[0]

    def _upload_url(self, query: dict[str, str]) -> str:
        return f"{self.endpoint}/upload/storage/v1/b/{self.bucket_name}/o?{urllib.parse.urlencode(query)}"

    def _holds(self, key: str, data: bytes) -> bool:
        try:
            return self.read_bytes(key) == data
        except FileNotFoundError:
            return False

    def write_bytes(self, key: str, data: bytes, *, if_match: str | None = None) -> str | None:
        """Upload ``key``; with ``if_match`` (a generation from :meth:`etag` or an earlier write) only
        if that is still its generation (``ifGenerationMatch``), else PreconditionFailed (also when
        the key is gone). Returns the new generation.

        A retried conditional upload whose first attempt landed (its answer lost on the way) is
        answered 412; then the key is read back: holding our bytes, it is ours."""
        if if_match is None:
            return self._upload(key, bytes(data), None)[0]
        try:
            return self._upload(key, bytes(data), int(if_match))[0]
        except PreconditionFailed as err:
            if getattr(err, "attempts", 1) > 1 and self._holds(key, data):
                self._count("conditional_read_back")
                return self.etag(key)
            raise

    def write_if_absent(self, key: str, data: bytes) -> bool:
        """Create ``key`` only if absent (``ifGenerationMatch=0``); False if it exists. A retried
        request whose first attempt landed is answered 412: the key is then read back, and holding
        our bytes it counts as created (callers write content unique to them: holder, nonce)."""
        try:
            self._upload(key, bytes(data), 0)
            return True
        except PreconditionFailed as err:
            if getattr(err, "attempts", 1) > 1 and self._holds(key, data):
                self._count("conditional_read_back")
                return True
            return False

    def upload_file(self, key: str, path: str | os.PathLike) -> None:
        """One request below CHUNK_SIZE, else a resumable upload of CHUNK_SIZE chunks, each retried."""
        writer = self.open_writer(key)
        try:
            with open(path, "rb") as fh:
                while chunk := fh.read(CHUNK_SIZE):
                    writer.write(chunk)
        except BaseException:
            writer.abort()
            raise
        writer.close()

    def download_file(self, key: str, path: str | os.PathLike) -> None:
        blob = self.bucket.blob(self._name(key))
        path = Path(path)
        tmp = path.with_name(f".{path.name}.download")
        self._call("get", lambda: blob.download_to_filename(str(tmp), retry=None, timeout=self.timeout), key=key)
        os.replace(tmp, path)

    def exists(self, key: str) -> bool:
        return self.etag(key) is not None

    def etag(self, key: str) -> str | None:
        """The generation of ``key`` (what ``write_bytes(if_match=...)`` takes) or None if absent."""
        name = self._name(key)
        blob = self._call("stat", lambda: self.bucket.get_blob(name, retry=None, timeout=self.timeout), key=key,
                          missing="bucket")
        return None if blob is None else str(blob.generation)

    def list(self, prefix: str = "", recursive: bool = True) -> list[str]:
        """Keys under ``prefix`` relative to the root; non-recursive gives sub-"directories" with ``/``."""
        full = self._name(prefix) if prefix else (self.prefix + "/" if self.prefix else "")
        if full and not full.endswith("/"):
            full += "/"
        strip = len(self.prefix) + 1 if self.prefix else 0

        def listing() -> list[str]:
            blobs = self.client.list_blobs(self.bucket_name, prefix=full, delimiter=None if recursive else "/",
                                           retry=None, timeout=self.timeout)
            names = [b.name[strip:] for b in blobs]
            return names + [p[strip:] for p in blobs.prefixes]

        return sorted(self._call("list", listing, key=prefix, missing="bucket"))

    def delete(self, key: str) -> None:
        blob = self.bucket.blob(self._name(key))
        with contextlib.suppress(FileNotFoundError):
            self._call("delete", lambda: blob.delete(retry=None, timeout=self.timeout), key=key)

    def delete_many(self, keys: Iterable[str]) -> None:
        """Delete each key (absent ones are no error)."""
        for key in keys:
            self.delete(key)

    def abort_incomplete_uploads(self, prefix: str) -> int:
        """0: GCS lists no open resumable sessions, and the one a killed writer left holds no
        object, is never billed and expires a week after it was opened (a writer that aborts
        cancels its own). The method is here for the protocol; it makes no request."""
        return 0

    def uri_for(self, key: str) -> str:
        return join_uri(self.uri, key)


class _ResumableWriter:
    """Buffers up to CHUNK_SIZE; a key that stays below it goes up in one request at close, a larger
    one through a resumable session, chunk by chunk, each PUT retried from where the server says it
    stands (``Content-Range: bytes */*`` asks)."""

    def __init__(self, store: GCSStore, key: str):
        self.store, self.key, self.name = store, key, store._name(key)
        self.buf = bytearray()
        self.session_url: str | None = None
        self.sent = 0
        self.closed = False

    def write(self, data: Any) -> None:
        view = byte_view(data)
        while len(view):
            if len(self.buf) >= CHUNK_SIZE:  # more follows: this chunk is not the last
                self._send(final=False)
            take = min(CHUNK_SIZE - len(self.buf), len(view))
            self.buf += view[:take]
            view = view[take:]

    def _start(self) -> None:
        store = self.store
        url = store._upload_url({"uploadType": "resumable", "name": self.name})

        def start() -> str:
            resp = store.session.post(url, json={"contentType": "application/octet-stream"},
                                      headers={"X-Upload-Content-Type": "application/octet-stream"},
                                      timeout=store.timeout)
            _raise_for(resp)
            return resp.headers["Location"]

        self.session_url = store._call("resumable_start", start, key=self.key, missing="bucket")

    def _send(self, *, final: bool) -> None:
        store, chunk = self.store, bytes(self.buf)
        if self.session_url is None:
            self._start()
        start, total = self.sent, (self.sent + len(chunk) if final else None)
        tries = [0]

        def put() -> None:
            tries[0] += 1
            offset = start
            if tries[0] > 1:  # where does the session stand after the failed attempt?
                offset = self._persisted(total)
                if offset is None:
                    return  # finalized by the attempt whose answer was lost
            body = chunk[offset - start:]
            size = "*" if total is None else str(total)
            rng = f"bytes {offset}-{offset + len(body) - 1}/{size}" if body else f"bytes */{size}"
            resp = store.session.put(self.session_url, data=body, headers={"Content-Range": rng},
                                     timeout=store.timeout)
            if resp.status_code == 308 and not final:
                return
            _raise_for(resp)

        store._call("resumable_chunk", put, key=self.key, missing="bucket")
        store._add_bytes("bytes_written", len(chunk))
        self.sent += len(chunk)
        self.buf = bytearray()

    def _persisted(self, total: int | None) -> int | None:
        """Bytes the session holds (None: it is finalized, which only the last chunk can have done).

        Raises:
            TransientFailure: the server finalized the object before its last chunk (fake-gcs-server
                answers a status query so, fsouza/fake-gcs-server#1362; GCS never does).
        """
        size = "*" if total is None else str(total)
        resp = self.store.session.put(self.session_url, headers={"Content-Range": f"bytes */{size}"},
                                      timeout=self.store.timeout)
        if resp.status_code in (200, 201):
            if total is None:
                raise TransientFailure(f"GCS upload of {self.store.uri_for(self.key)}: the server finalized it at "
                                       f"a status query, before its last chunk (an emulator without resumable "
                                       f"status queries?)")
            return None
        if resp.status_code != 308:
            _raise_for(resp)
        got = re.fullmatch(r"bytes=0-(\d+)", resp.headers.get("Range", ""))
        return int(got[1]) + 1 if got else 0

    def close(self) -> None:
        if self.closed:
            return
        try:
            if self.session_url is None:
                self.store._upload(self.key, bytes(self.buf), None)
            else:
                self._send(final=True)
        except BaseException:
            self.abort()
            raise
        self.closed = True

    def abort(self) -> None:
        self.closed = True
        self.buf = bytearray()
        if self.session_url is not None:
            # best effort, one request: GCS cancels the session (499); if it fails, the session
            # expires in a week and was never billed
            with contextlib.suppress(Exception):
                self.store._count("resumable_cancel")
                self.store.session.delete(self.session_url, timeout=self.store.timeout)
            self.session_url = None


def _raise_for(resp: Any) -> None:
    """The google.api_core exception of a non-2xx answer (what the client itself raises)."""
    if resp.status_code < 300 or resp.status_code == 308:
        return
    from google.api_core import exceptions as gx

    resp.content  # noqa: B018 - read the error body so the exception carries its message
    raise gx.from_http_response(resp)


def _is_transient(err: BaseException) -> bool:
    import requests.exceptions as rq
    import urllib3.exceptions as ue
    from google.auth.exceptions import TransportError

    if isinstance(err, (rq.ConnectionError, rq.Timeout, rq.ChunkedEncodingError, TransportError)):
        return True
    if isinstance(err, (ue.HTTPError, ConnectionError, TimeoutError)):
        return not isinstance(err, ue.LocationValueError)
    return isinstance(err, OSError) and not isinstance(err, (FileNotFoundError, PermissionError))
