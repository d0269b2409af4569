"""The Google Cloud Storage driver, ``gs://bucket/prefix``, through the official ``google-cloud-storage``
client (and its ``google-auth`` session for ranged reads, uploads and resumable sessions).

The protocol is :class:`~relaunch.components.core.store.object_store.ObjectStore`'s; this module turns its
requests into GCS calls and the client's errors into
:class:`~relaunch.components.core.store.object_store.Fault` by their type: connection errors, timeouts, 429
and 5xx are transient; refused credentials, a missing bucket and other 4xx answers are bad input.
Conditional writes are generation preconditions: ``ifGenerationMatch=0`` creates only, the
generation read before (``etag``) replaces only that version. An object that goes up in one request
goes as a multipart upload (GCS evaluates preconditions on every upload, fake-gcs-server, the
emulator of the tests, on multipart ones only). Larger objects go up as resumable uploads, one chunk
at a time in order, a retried chunk resuming where the server says it stands.

Configuration, from the environment only, as the official client reads it:
``STORAGE_EMULATOR_HOST`` (``host:port`` or a URL; then no credentials are sent, as the official client
does for emulators); otherwise Application Default Credentials: ``GOOGLE_APPLICATION_CREDENTIALS``
(a key file, e.g. mounted from a Kubernetes Secret) or workload identity (the metadata server).
``GOOGLE_CLOUD_PROJECT`` is optional.

Uploads a killed writer left: GCS has no listing of open resumable sessions (S3 has
ListMultipartUploads). A writer that aborts cancels its own session (``DELETE`` on the session URI); a
session whose writer was killed holds no object, is never billed, and expires a week after it was
opened. So ``abort_incomplete_uploads`` has nothing to find and returns 0, making no request.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import urllib.parse
from pathlib import Path
from typing import Any, Callable, Iterator

from ..contract.errors import BadInput, TransientFailure
from . import register_backend
from .object_store import Fault, ObjectDriver, socket_readinto

CHUNK_SIZE = 64 * 1024 * 1024
"""Resumable upload chunk (a multiple of 256 KiB, as GCS requires); smaller objects go up in one request.
A session takes its chunks in order, one at a time, and each costs the server a round of its own
(fake-gcs-server's finalization grows with them): 64 MiB files saved side by side on one emulator,
16 MiB chunks took 1.8x the official client's time (whose default resumable chunk is 100 MiB),
64 MiB chunks 1.2x. A writer holds up to three chunks (the one going up, the one filling, its copy)."""
GCS_ENDPOINT = "https://storage.googleapis.com"
SCOPES = ("https://www.googleapis.com/auth/devstorage.read_write",)
_BUCKET = re.compile(r"[a-z0-9][a-z0-9._-]{1,220}[a-z0-9]")
_OBJECT_OPS = frozenset({"get", "get_range", "delete"})
"""The requests whose 404 means the object is missing; any other's means the bucket is."""


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
class GCSDriver(ObjectDriver):
    """GCS requests through the official client and its authorized session (their retries off)."""

    scheme = "gs"
    example = "gs://bucket/prefix"
    service = "GCS"
    credentials_hint = "GOOGLE_APPLICATION_CREDENTIALS or the workload identity, and the bucket's IAM policy"
    uri_hint = "set GOOGLE_APPLICATION_CREDENTIALS (or STORAGE_EMULATOR_HOST for an emulator)"
    CHECK_OP = "bucket_get"
    START_OP, PART_OP, FINISH_OP, ABORT_OP = "resumable_start", "resumable_chunk", None, "resumable_cancel"
    parallel_parts = 1  # a resumable session takes its chunks in order

    @classmethod
    def check_location(cls, location: str) -> None:
        if not _BUCKET.fullmatch(location) or ".." in location:
            raise ValueError(f"gs bucket name {location!r} is invalid (3-222 lowercase letters, digits, '-', '_', "
                             f"'.'; starting and ending with a letter or digit)")

    def __init__(self, bucket: str):
        import requests.adapters
        from google.auth.transport.requests import AuthorizedSession
        from google.cloud import storage

        self.location = self.bucket_name = bucket
        self.endpoint, credentials, project = _settings()
        self.client = storage.Client(project=project, credentials=credentials,
                                     client_options={"api_endpoint": self.endpoint})
        self.bucket = self.client.bucket(bucket)
        self.session = AuthorizedSession(credentials)
        adapter = requests.adapters.HTTPAdapter(pool_connections=4, pool_maxsize=16, max_retries=0)
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)
        self.timeout = (10, 60)

    @property
    def part_size(self) -> int:
        return CHUNK_SIZE

    @property
    def single_put_limit(self) -> int:
        return CHUNK_SIZE

    def identity(self) -> tuple:
        return self.endpoint, os.environ.get("GOOGLE_APPLICATION_CREDENTIALS", "")

    def fault(self, err: BaseException, op: str) -> tuple[Fault, Any] | None:
        import requests.exceptions as rq
        import urllib3.exceptions as ue
        from google.api_core import exceptions as gx
        from google.auth import exceptions as ga

        if isinstance(err, gx.NotFound):
            return (Fault.NOT_FOUND if op in _OBJECT_OPS else Fault.NO_CONTAINER), 404
        kinds = [(gx.PreconditionFailed, Fault.PRECONDITION), (gx.RequestRangeNotSatisfiable, Fault.SHORT),
                 (gx.Forbidden, Fault.FORBIDDEN), ((gx.Unauthorized, ga.RefreshError, ga.DefaultCredentialsError),
                                                   Fault.CREDENTIALS),
                 ((gx.RetryError, gx.TooManyRequests, gx.ServerError, rq.ConnectionError, rq.Timeout,
                   rq.ChunkedEncodingError, ga.TransportError), Fault.TRANSIENT)]
        for types, fault in kinds:
            if isinstance(err, types):
                return fault, getattr(err, "code", None) or type(err).__name__
        if isinstance(err, gx.GoogleAPICallError):
            return Fault.PERMANENT, f"{err.code} {err.message}"
        if isinstance(err, ue.HTTPError) and not isinstance(err, ue.LocationValueError):
            return Fault.TRANSIENT, type(err).__name__
        return None

    def check(self) -> bool:
        self.client.get_bucket(self.bucket_name, retry=None, timeout=self.timeout)
        return True

    def _media_url(self, name: str) -> str:
        return f"{self.endpoint}/download/storage/v1/b/{self.bucket_name}/o/{urllib.parse.quote(name, safe='')}?alt=media"

    def get(self, name: str) -> bytes:
        """One GET of the object's bytes on the session (the client's ``download_as_bytes`` costs ~15 ms
        of Python a call here, a checkpoint's small records are read at every restore and commit)."""
        resp = self.session.get(self._media_url(name), headers={"Accept-Encoding": "identity"}, timeout=self.timeout)
        _raise_for(resp)
        return resp.content

    @contextlib.contextmanager
    def open_range(self, name: str, offset: int, length: int) -> Iterator[Callable[[memoryview], int]]:
        url = self._media_url(name)
        resp = self.session.get(url, headers={"Range": f"bytes={offset}-{offset + length - 1}",
                                              "Accept-Encoding": "identity"}, stream=True, timeout=self.timeout)
        try:
            _raise_for(resp)
            if resp.status_code != 206 and offset:
                raise EOFError(f"gs://{self.bucket_name}/{name}: the server ignored the range asked for")
            yield socket_readinto(resp.raw) or resp.raw.readinto
        finally:
            resp.close()

    def download(self, name: str, path: Path) -> None:
        self.bucket.blob(name).download_to_filename(str(path), retry=None, timeout=self.timeout)

    def _upload_url(self, query: dict[str, str]) -> str:
        return f"{self.endpoint}/upload/storage/v1/b/{self.bucket_name}/o?{urllib.parse.urlencode(query)}"

    def put(self, name: str, data: bytes, *, if_absent: bool = False, if_match: str | None = None) -> str | None:
        """One multipart upload request: the object's name and its bytes in one body; returns the new
        generation.

        Multipart, not media: fake-gcs-server evaluates ``ifGenerationMatch`` on multipart uploads
        only. Our own request, not the client's ``upload_from_string``: that one draws its multipart
        boundary from the global ``random`` module, which would shift the training's python RNG
        stream (and break an exact resume) at every checkpoint."""
        query = {"uploadType": "multipart"}
        if if_absent or if_match is not None:
            query["ifGenerationMatch"] = "0" if if_absent else str(int(if_match))
        boundary = secrets.token_hex(16)
        body = b"".join([f"--{boundary}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n".encode(),
                         json.dumps({"name": name}).encode(),
                         f"\r\n--{boundary}\r\nContent-Type: application/octet-stream\r\n\r\n".encode(), data,
                         f"\r\n--{boundary}--\r\n".encode()])
        resp = self.session.post(self._upload_url(query), data=body, timeout=self.timeout,
                                 headers={"Content-Type": f"multipart/related; boundary={boundary}"})
        _raise_for(resp)
        return str(resp.json()["generation"])

    def version(self, name: str) -> str | None:
        blob = self.bucket.get_blob(name, retry=None, timeout=self.timeout)
        return None if blob is None else str(blob.generation)

    def listing(self, prefix: str, recursive: bool) -> Iterator[tuple[str, int | None]]:
        blobs = self.client.list_blobs(self.bucket_name, prefix=prefix, delimiter=None if recursive else "/",
                                       retry=None, timeout=self.timeout)
        for b in blobs:
            yield b.name, int(b.size or 0)
        for p in blobs.prefixes:  # known once the pages are read
            yield p, None

    def delete(self, name: str) -> None:
        self.bucket.blob(name).delete(retry=None, timeout=self.timeout)

    def start_upload(self, name: str) -> str:
        resp = self.session.post(self._upload_url({"uploadType": "resumable", "name": name}),
                                 json={"contentType": "application/octet-stream"},
                                 headers={"X-Upload-Content-Type": "application/octet-stream"}, timeout=self.timeout)
        _raise_for(resp)
        return resp.headers["Location"]

    def upload_part(self, name: str, handle: str, number: int, offset: int, data: bytes, total: int | None,
                    retried: bool) -> None:
        """PUT one chunk to the session ``handle``; a retry first asks where the session stands
        (``Content-Range: bytes */*``) and sends the rest from there."""
        start = offset
        if retried:
            offset = self._persisted(name, handle, total)
            if offset is None:
                return  # finalized by the attempt whose answer was lost
        body = data[offset - start:]
        size = "*" if total is None else str(total)
        rng = f"bytes {offset}-{offset + len(body) - 1}/{size}" if body else f"bytes */{size}"
        resp = self.session.put(handle, data=body, headers={"Content-Range": rng}, timeout=self.timeout)
        _raise_for(resp)

    def _persisted(self, name: str, handle: str, total: int | None) -> int | None:
        """Bytes the session holds (None: it is finalized, which only the last chunk can have done).

        Raises:
            TransientFailure: the server finalized the object before its last chunk (fake-gcs-server
                answers a status query so, fsouza/fake-gcs-server#1362; GCS never does).
        """
        size = "*" if total is None else str(total)
        resp = self.session.put(handle, headers={"Content-Range": f"bytes */{size}"}, timeout=self.timeout)
        if resp.status_code in (200, 201):
            if total is None:
                raise TransientFailure(f"GCS upload of gs://{self.bucket_name}/{name}: the server finalized it at "
                                       f"a status query, before its last chunk (an emulator without resumable "
                                       f"status queries?)")
            return None
        if resp.status_code != 308:
            _raise_for(resp)
        got = re.fullmatch(r"bytes=0-(\d+)", resp.headers.get("Range", ""))
        return int(got[1]) + 1 if got else 0

    def abort_upload(self, name: str, handle: str) -> None:
        """Cancel the session (GCS answers 499); one that stays expires in a week and was never billed."""
        self.session.delete(handle, timeout=self.timeout)


def _raise_for(resp: Any) -> None:
    """The google.api_core exception of a non-2xx answer (what the client itself raises); 308 is a
    resumable session's "send on"."""
    if resp.status_code < 300 or resp.status_code == 308:
        return
    from google.api_core import exceptions as gx

    resp.content  # noqa: B018 - read the error body so the exception carries its message
    raise gx.from_http_response(resp)
