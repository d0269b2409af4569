"""Does a store honour conditional writes? The write lease, its fencing and the commit point rely on a
create-if-absent that refuses an existing key and a replace that refuses a changed one; a store that
lets both land (gcp-storage-emulator does) would let two writers of one training both win, and the
once-only failure injection fire at every restart. A training refuses such a store when it opens it
for writing (:func:`require_conditional_writes`), in one line, exit 2.
"""

from __future__ import annotations

import contextlib
import threading
import uuid

from ..contract.errors import BadInput
from . import PreconditionFailed, Store

PROBE_PREFIX = ".relaunch-probe/"
"""Where the probe writes its key (unique per probe, deleted after it)."""

_PROVEN: set[str] = set()
"""Store URIs this process proved honour conditional writes."""
_LOCK = threading.Lock()


def require_conditional_writes(store: Store) -> None:
    """Prove, once per store URI per process, that ``store`` honours conditional writes: a fresh key
    under :data:`PROBE_PREFIX` is created if absent, a second create of it must be refused, a replace
    on its generation (ETag) must land and a second replace on that same, now stale, one must be
    refused (:class:`PreconditionFailed`); then the key is deleted.

    Raises:
        BadInput: the store let a conditional write land that it had to refuse (one line naming the
            store, what to use instead).
    """
    with _LOCK:
        if store.uri in _PROVEN:
            return
        key = f"{PROBE_PREFIX}{uuid.uuid4().hex}"
        try:
            ignored = _ignored_condition(store, key)
        except BaseException:
            with contextlib.suppress(Exception):  # the probe's own error says what is wrong
                store.delete(key)
            raise
        store.delete(key)
        if ignored:
            raise BadInput(f"store {store.uri} ignores conditional writes ({ignored}); the checkpoint lease, its "
                           f"fencing and the commit point depend on them: use a store that honours them (GCS, S3, "
                           f"Azure Blob, a filesystem; as a GCS emulator fake-gcs-server, not gcp-storage-emulator)")
        _PROVEN.add(store.uri)


def _ignored_condition(store: Store, key: str) -> str:
    """Which conditional write of the probe landed although it had to be refused ("" if none)."""
    if not store.write_if_absent(key, b"created"):
        return "a create-if-absent of a new key was refused"
    if store.write_if_absent(key, b"created again"):
        return "a create-if-absent of an existing key landed"
    read = store.etag(key)
    store.write_bytes(key, b"replaced", if_match=read)
    try:
        store.write_bytes(key, b"replaced again", if_match=read)
    except PreconditionFailed:
        return ""
    return "a replace of a key that changed since it was read landed"
