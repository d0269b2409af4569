"""The S3 driver: any S3-compatible server through the ``minio`` client, ``s3://bucket/prefix``.

The protocol (retries, ranged reads, conditional writes, uploads in parts) is
:class:`~relaunch.components.core.store.object_store.ObjectStore`'s; this module turns its requests into S3
calls and S3's errors into :class:`~relaunch.components.core.store.object_store.Fault` by their error code:
SlowDown, 5xx and broken connections are transient (retried, then exit 138); refused credentials,
NoSuchBucket and other 4xx answers are bad input (exit 2); a write refused for good (AccessDenied,
a quota) means the store cannot be written.

S3 configuration, from the environment only (never from arguments that end up in logs):
``AWS_ENDPOINT_URL`` (``http(s)://host:port``; TLS from the scheme), ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_REGION``/``AWS_DEFAULT_REGION``; or the MinIO
equivalents ``MINIO_ENDPOINT`` (``host:port`` or a URL), ``MINIO_ACCESS_KEY``, ``MINIO_SECRET_KEY``,
``MINIO_SECURE`` (``true``/``false``), ``MINIO_REGION``.

The minio and urllib3 private calls this module needs (conditional PUTs, per-part retried
multipart uploads, ListMultipartUploads, reads from the socket into our buffers) all go through
:class:`_MinioCalls` at the end of this file, whose recorded signatures a test checks.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import urllib.parse
from pathlib import Path
from typing import Any, Callable, Iterator

from ..contract.classify import S3_CREDENTIAL_CODES, S3_TRANSIENT_CODES
from ..contract.errors import BadInput
from . import register_backend
from .object_store import Fault, ObjectDriver, socket_readinto

S3_REFUSED_WRITE_CODES = frozenset({"AccessDenied", "QuotaExceeded", "XMinioStorageFull",
                                    "XMinioAdminBucketQuotaExceeded", "XMinioBucketQuotaExceeded"})
"""S3 error codes of a request refused for good: on a write (read-only credentials or policy, a full
disk or bucket quota), the store cannot be written."""

MULTIPART_THRESHOLD = 64 * 1024 * 1024
"""A file below this goes up in one PUT (``upload_file``)."""
PART_SIZE = 32 * 1024 * 1024


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


@register_backend
class S3Driver(ObjectDriver):
    """S3 requests through ``minio`` (its own retries off: the store retries)."""

    scheme = "s3"
    example = "s3://bucket/prefix"
    service = "S3"
    credentials_hint = "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY and the bucket policy"
    uri_hint = "set AWS_ENDPOINT_URL and AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY"
    CHECK_OP = "bucket_exists"
    START_OP, PART_OP, FINISH_OP, ABORT_OP = "multipart_create", "multipart_part", "multipart_complete", "multipart_abort"
    UPLOAD_LIST_OP = "multipart_list"
    DELETE_BATCH = 1000

    @classmethod
    def check_location(cls, location: str) -> None:
        if len(location) < 3 or len(location) > 63 or not all(c.islower() or c.isdigit() or c in "-." for c in location):
            raise ValueError(f"s3 bucket name {location!r} is invalid (3-63 lowercase letters, digits, '-', '.')")

    def __init__(self, bucket: str):
        import urllib3
        from minio import Minio

        s = _s3_settings()
        self.location = self.bucket = bucket
        self.endpoint = s["endpoint"]
        self._proof = (s["endpoint"], s["secure"], s["access_key"],
                       hashlib.sha256(f"{s['secret_key']}|{s['session_token']}".encode()).hexdigest())
        http = urllib3.PoolManager(
            timeout=urllib3.Timeout(connect=10, read=60), maxsize=16, retries=False,
            cert_reqs="CERT_REQUIRED" if s["cert_check"] else "CERT_NONE",
            ca_certs=os.environ.get("SSL_CERT_FILE") or _certifi_where())
        self.client = Minio(s["endpoint"], access_key=s["access_key"], secret_key=s["secret_key"],
                            session_token=s["session_token"], secure=s["secure"], region=s["region"],
                            http_client=http)
        self._minio = _MinioCalls(self.client)

    @property
    def part_size(self) -> int:
        return PART_SIZE

    @property
    def single_put_limit(self) -> int:
        return MULTIPART_THRESHOLD

    def identity(self) -> tuple:
        return self._proof

    def fault(self, err: BaseException, op: str) -> tuple[Fault, Any] | None:
        import urllib3.exceptions as ue
        from minio.error import InvalidResponseError, S3Error, ServerError

        if isinstance(err, (ServerError, InvalidResponseError)):  # a 5xx, or a non-S3 body: a proxy in the way
            return Fault.TRANSIENT, type(err).__name__
        if isinstance(err, ue.HTTPError):
            return None if isinstance(err, ue.LocationValueError) else (Fault.TRANSIENT, type(err).__name__)
        if not isinstance(err, S3Error):
            return None
        code = err.code
        if code in ("NoSuchKey", "NoSuchUpload") or (code == "ResourceNotFound" and op != self.CHECK_OP):
            return Fault.NOT_FOUND, code
        known = {"InvalidRange": Fault.SHORT, "NoSuchBucket": Fault.NO_CONTAINER,
                 "PreconditionFailed": Fault.PRECONDITION}
        if code in known:
            return known[code], code
        if code in S3_REFUSED_WRITE_CODES:
            return Fault.FORBIDDEN, code
        if code in S3_CREDENTIAL_CODES:
            return Fault.CREDENTIALS, code
        if code in S3_TRANSIENT_CODES or (getattr(err.response, "status", 0) or 0) >= 500:
            return Fault.TRANSIENT, code
        return Fault.PERMANENT, f"{code}: {err.message}"

    def check(self) -> bool:
        return self.client.bucket_exists(self.bucket)

    @contextlib.contextmanager
    def _object(self, name: str, **ranged: int) -> Iterator[Any]:
        resp = self.client.get_object(self.bucket, name, **ranged)
        try:
            yield resp
        finally:
            resp.close()
            resp.release_conn()

    def get(self, name: str) -> bytes:
        with self._object(name) as resp:
            return resp.read()

    @contextlib.contextmanager
    def open_range(self, name: str, offset: int, length: int) -> Iterator[Callable[[memoryview], int]]:
        with self._object(name, offset=offset, length=length) as resp:
            yield _MinioCalls.socket_readinto(resp) or resp.readinto

    def download(self, name: str, path: Path) -> None:
        with self._object(name) as resp, open(path, "wb") as fh:
            for chunk in resp.stream(8 * 1024 * 1024):
                fh.write(chunk)

    def put(self, name: str, data: bytes, *, if_absent: bool = False, if_match: str | None = None) -> str | None:
        headers = {"Content-Type": "application/octet-stream"}
        if if_absent:
            headers["If-None-Match"] = "*"
        if if_match is not None:
            headers["If-Match"] = if_match
        return getattr(self._minio.put(self.bucket, name, data, headers), "etag", None)

    def version(self, name: str) -> str | None:
        return self.client.stat_object(self.bucket, name).etag

    def listing(self, prefix: str, recursive: bool) -> Iterator[tuple[str, int | None]]:
        for o in self.client.list_objects(self.bucket, prefix=prefix, recursive=recursive):
            yield o.object_name, None if o.is_dir else int(o.size or 0)

    def delete(self, name: str) -> None:
        self.client.remove_object(self.bucket, name)

    def delete_batch(self, names: list[str]) -> list:
        from minio.deleteobjects import DeleteObject

        return list(self.client.remove_objects(self.bucket, [DeleteObject(n) for n in names]))

    def start_upload(self, name: str) -> str:
        return self._minio.create_upload(self.bucket, name)

    def upload_part(self, name: str, handle: str, number: int, offset: int, data: bytes, total: int | None,
                    retried: bool) -> Any:
        from minio.datatypes import Part

        return Part(number, self._minio.upload_part(self.bucket, name, handle, number, data))

    def finish_upload(self, name: str, handle: str, parts: list) -> None:
        self._minio.complete_upload(self.bucket, name, handle, parts)

    def abort_upload(self, name: str, handle: str) -> None:
        self._minio.abort_upload(self.bucket, name, handle)

    def incomplete_uploads(self, prefix: str) -> list[tuple[str, str]]:
        found: dict[str, str] = {}
        key_marker = upload_marker = None
        while True:
            page = self._minio.list_uploads(self.bucket, prefix, key_marker, upload_marker)
            found.update((u.upload_id, u.object_name) for u in page.uploads)
            if not page.is_truncated or not page.uploads:
                return [(name, upload_id) for upload_id, name in found.items()]
            key_marker, upload_marker = page.uploads[-1].object_name, page.uploads[-1].upload_id


def _certifi_where() -> str | None:
    try:
        import certifi

        return certifi.where()
    except ImportError:  # pragma: no cover - minio depends on certifi
        return None


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
        return socket_readinto(resp)
