"""The Azure Blob driver, ``az://container/prefix``, through the official ``azure-storage-blob``.

The protocol is :class:`~relaunch.components.core.store.object_store.ObjectStore`'s; this module turns its
requests into Blob service calls and the SDK's errors into
:class:`~relaunch.components.core.store.object_store.Fault` by their type, error code and status: no answer,
a body cut short, 408, 429 and 5xx are transient; rejected credentials, a missing container and other
4xx answers are bad input; a write answered 403 means the store cannot be written.

Credentials and endpoint from the environment only, with the names the Azure SDKs and the ``az`` CLI
use: ``AZURE_STORAGE_CONNECTION_STRING`` (its ``BlobEndpoint`` points at Azurite or another
endpoint; ``AccountKey`` or ``SharedAccessSignature`` inside it), else ``AZURE_STORAGE_ACCOUNT`` with
``AZURE_STORAGE_KEY`` (account key) or ``AZURE_STORAGE_SAS_TOKEN`` (a SAS), at
``https://<account>.blob.core.windows.net`` unless ``AZURE_STORAGE_BLOB_ENDPOINT`` says otherwise.

Conditional writes are on ETags (``If-None-Match: *`` to create, ``If-Match`` to replace). Large
objects go up as staged blocks (Put Block, then Put Block List); the blocks of a writer killed before
its Put Block List stay uncommitted, invisible to readers, until Azure garbage-collects them after 7
days; ``abort_incomplete_uploads`` drops them at once (Azure has no abort call: an empty block list is
committed with ``If-None-Match: *``, so a blob committed meanwhile is never touched, and the empty
blob is deleted).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
import re
from pathlib import Path
from typing import Any, Callable, Iterator

from ..contract.errors import BadInput
from . import register_backend
from .object_store import Fault, ObjectDriver, readinto_of

SINGLE_PUT_LIMIT = 64 * 1024 * 1024  # the SDK's own splitting of one upload_blob call (ours stay below a block)
BLOCK_SIZE = 32 * 1024 * 1024
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



@register_backend
class AzureDriver(ObjectDriver):
    """Blob service requests through ``azure-storage-blob`` (its own retries off)."""

    scheme = "az"
    example = "az://container/prefix"
    service = "Azure"
    container_kind = "container"
    credentials_hint = "AZURE_STORAGE_CONNECTION_STRING / AZURE_STORAGE_KEY / the SAS"
    uri_hint = "set AZURE_STORAGE_CONNECTION_STRING"
    CHECK_OP = "container_properties"
    START_OP, PART_OP, FINISH_OP, ABORT_OP = None, "stage_block", "commit_block_list", "uncommitted_drop"
    UPLOAD_LIST_OP = "uncommitted_list"
    ABORT_LEAVES_OBJECT = True

    @classmethod
    def check_location(cls, location: str) -> None:
        if not _CONTAINER.match(location):
            raise ValueError(f"az container name {location!r} is invalid (3-63 lowercase letters, digits and "
                             f"single '-', starting and ending with a letter or digit)")

    def __init__(self, container: str):
        from azure.storage.blob import BlobServiceClient

        self.location = self.container_name = container
        s = azure_settings()
        self._proof = (hashlib.sha256(repr(sorted(s.items())).encode()).hexdigest(),)
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

    @property
    def part_size(self) -> int:
        return BLOCK_SIZE

    @property
    def single_put_limit(self) -> int:
        return BLOCK_SIZE

    def identity(self) -> tuple:
        return self._proof

    def fault(self, err: BaseException, op: str) -> tuple[Fault, Any] | None:
        from azure.core.exceptions import (ClientAuthenticationError, HttpResponseError, IncompleteReadError,
                                           ResourceExistsError, ResourceModifiedError, ResourceNotFoundError,
                                           ServiceRequestError, ServiceResponseError)

        if isinstance(err, (ServiceRequestError, ServiceResponseError, IncompleteReadError)):
            return Fault.TRANSIENT, type(err).__name__  # no answer, or a body cut short
        if not isinstance(err, HttpResponseError):
            return None
        code, status = str(getattr(err.error_code, "value", err.error_code) or ""), err.status_code
        if status is None:  # an answer cut short or undecodable in flight
            return Fault.TRANSIENT, type(err).__name__
        if code == "ContainerNotFound":
            return Fault.NO_CONTAINER, code
        if status == 403:
            return Fault.FORBIDDEN, code or status
        if isinstance(err, ClientAuthenticationError) or code in _CREDENTIAL_CODES or status == 401:
            return Fault.CREDENTIALS, code or status
        if isinstance(err, ResourceNotFoundError) or status == 404:
            return Fault.NOT_FOUND, code or status
        if code == "InvalidRange" or status == 416:
            return Fault.SHORT, code or status
        if isinstance(err, (ResourceModifiedError, ResourceExistsError)) or status in (409, 412):
            return Fault.PRECONDITION, code or status
        if status < 500 and status not in (408, 429):
            return Fault.PERMANENT, f"{code or status}: {str(err.message or err).splitlines()[0][:200]}"
        return Fault.TRANSIENT, code or status

    def _blob(self, name: str) -> Any:
        return self.container.get_blob_client(name)

    def check(self) -> bool:
        self.container.get_container_properties()
        return True

    def get(self, name: str) -> bytes:
        return self._blob(name).download_blob(max_concurrency=1).readall()

    @contextlib.contextmanager
    def open_range(self, name: str, offset: int, length: int) -> Iterator[Callable[[memoryview], int]]:
        """The SDK's ranged download: a first GET of up to 32 MiB, then 4 MiB GETs, chunk by chunk."""
        yield readinto_of(self._blob(name).download_blob(offset=offset, length=length, max_concurrency=1).chunks())

    def download(self, name: str, path: Path) -> None:
        with open(path, "wb") as fh:
            self._blob(name).download_blob(max_concurrency=4).readinto(fh)

    def put(self, name: str, data: bytes, *, if_absent: bool = False, if_match: str | None = None) -> str | None:
        from azure.core import MatchConditions

        condition = {} if if_match is None else {"etag": if_match, "match_condition": MatchConditions.IfNotModified}
        return self._blob(name).upload_blob(data, blob_type="BlockBlob", length=len(data), max_concurrency=1,
                                            overwrite=not if_absent, **condition).get("etag")

    def version(self, name: str) -> str | None:
        return self._blob(name).get_blob_properties().etag

    def listing(self, prefix: str, recursive: bool) -> Iterator[tuple[str, int | None]]:
        found = (self.container.list_blobs(name_starts_with=prefix or None) if recursive
                 else self.container.walk_blobs(prefix or None, delimiter="/"))
        for b in found:  # a BlobPrefix (a "directory") has no size
            yield b.name, int(b.size or 0) if hasattr(b, "size") and not b.name.endswith("/") else None

    def delete(self, name: str) -> None:
        self._blob(name).delete_blob()

    def start_upload(self, name: str) -> None:
        return None  # blocks are staged under the blob's name; nothing to open

    def upload_part(self, name: str, handle: None, number: int, offset: int, data: bytes, total: int | None,
                    retried: bool) -> str:
        # Block ids must all have the same length within a blob: a fixed-width number.
        block_id = base64.b64encode(f"relaunch-{number - 1:08d}".encode()).decode()
        self._blob(name).stage_block(block_id, data, length=len(data))
        return block_id

    def finish_upload(self, name: str, handle: None, parts: list) -> None:
        from azure.storage.blob import BlobBlock

        self._blob(name).commit_block_list([BlobBlock(i) for i in parts])

    def abort_upload(self, name: str, handle: None) -> None:
        """Commit an empty block list unless the blob exists (its uncommitted blocks go with it); the
        store deletes the empty blob after."""
        self._blob(name).commit_block_list([], if_none_match="*")

    def incomplete_uploads(self, prefix: str) -> list[tuple[str, None]]:
        start = prefix or None
        every = {b.name for b in self.container.list_blobs(name_starts_with=start, include=["uncommittedblobs"])}
        committed = {b.name for b in self.container.list_blobs(name_starts_with=start)}
        return [(name, None) for name in sorted(every - committed)]
