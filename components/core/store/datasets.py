"""Content-addressed dataset versions in the store.

``datasets/<version>/splits.npz`` holds every split's arrays (numpy ``.npz``, read back with
``allow_pickle=False``: nothing stored is ever unpickled); ``datasets/<version>/MANIFEST.json``,
written last, is the commit point and carries the file's sha256 and every array's dtype and shape.
The version is ``sha256-<16 hex>`` of the arrays' canonical bytes (split and key names sorted, dtype,
shape, C-order data), so the same data always gets the same version and is written once.
"""

from __future__ import annotations

import hashlib
import io
import json

import numpy as np

from relaunch.components.core.contract.errors import BadInput, CorruptCheckpoint

Splits = dict[str, dict[str, np.ndarray]]
_PREFIX = "datasets"


def dataset_version(splits: Splits) -> str:
    """The content address of ``splits``: ``sha256-`` + 16 hex digits of their canonical bytes."""
    digest = hashlib.sha256()
    for split in sorted(splits):
        for key in sorted(splits[split]):
            array = np.ascontiguousarray(splits[split][key])
            if array.dtype.hasobject:
                raise BadInput(f"dataset split {split!r} key {key!r}: object arrays cannot be stored safely")
            digest.update(f"{split}/{key}:{array.dtype.str}:{array.shape}\n".encode())
            digest.update(array.tobytes())
    return "sha256-" + digest.hexdigest()[:16]


def _key(version: str, name: str) -> str:
    return f"{_PREFIX}/{version}/{name}"


def write_dataset(store, splits: Splits) -> str:
    """Store ``splits`` under their content address and return the version; a no-op when present.

    Raises:
        BadInput: an empty split set or object arrays.
    """
    if not splits or not all(splits.values()):
        raise BadInput("dataset: no splits or an empty split; the task's build_splits returned nothing")
    version = dataset_version(splits)
    if store.exists(_key(version, "MANIFEST.json")):
        return version
    buffer = io.BytesIO()
    np.savez(buffer, **{f"{split}.{key}": np.ascontiguousarray(a)
                        for split, arrays in splits.items() for key, a in arrays.items()})
    payload = buffer.getvalue()
    store.write_bytes(_key(version, "splits.npz"), payload)
    manifest = {
        "version": version,
        "format": "npz",
        "file": "splits.npz",
        "sha256": hashlib.sha256(payload).hexdigest(),
        "size": len(payload),
        "arrays": {f"{s}.{k}": {"dtype": a.dtype.str, "shape": list(a.shape)}
                   for s, arrays in sorted(splits.items()) for k, a in sorted(arrays.items())},
    }
    store.write_bytes(_key(version, "MANIFEST.json"), json.dumps(manifest, indent=2, sort_keys=True).encode())
    return version


def read_dataset(store, version: str) -> Splits:
    """Load a stored version, verifying the file's sha256 and the content address.

    Raises:
        BadInput: the version does not exist in this store.
        CorruptCheckpoint: the file does not match its manifest or its address.
    """
    if not store.exists(_key(version, "MANIFEST.json")):
        raise BadInput(f"data.version: {version!r} is not in the store {dataset_uri(store, version)!r}; "
                       "run the prepare step or unset data.version")
    manifest = json.loads(store.read_bytes(_key(version, "MANIFEST.json")))
    payload = store.read_bytes(_key(version, manifest["file"]))
    if hashlib.sha256(payload).hexdigest() != manifest["sha256"]:
        raise CorruptCheckpoint(f"dataset {version}: splits.npz does not match the sha256 in its MANIFEST.json")
    splits: Splits = {}
    with np.load(io.BytesIO(payload), allow_pickle=False) as npz:
        for name in npz.files:
            split, key = name.split(".", 1)
            splits.setdefault(split, {})[key] = npz[name]
    if dataset_version(splits) != version:
        raise CorruptCheckpoint(f"dataset {version}: its arrays hash to {dataset_version(splits)}, not to its address")
    return splits


def dataset_uri(store, version: str) -> str:
    """The URI of a version's folder, for MLflow params and logs."""
    return store.uri_for(f"{_PREFIX}/{version}")
