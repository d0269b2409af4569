"""Is a checkpoint intact? Three depths, from cheap to full.

- :func:`check_files` (``latest()``): the manifest parses and every file it lists exists with its
  size. One listing of the step directory, no data read: O(1) requests whatever the size.
- the read itself (format 2): every chunk a rank reads is checked against its XXH3-128 digest in the
  manifest as its bytes arrive (:class:`ChunkDigests`, used by ``dcp_io.StoreReader``).
- :func:`deep_verify` (``relaunch checkpoints verify --deep``): read every byte of every file. Format
  1: sha256 of each file; format 2: every chunk digest, and the chunks must tile each file exactly.

Why XXH3-128 and not crc32c or sha256: measured on the 2-core build machine, xxhash's XXH3-128
hashes ~7 GB/s straight from a writable buffer (a tensor); google-crc32c reaches ~6 GB/s but only
accepts read-only ``bytes``, so a tensor would first be copied (~0.4 GB/s here); sha256 is ~0.8 GB/s.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
from typing import Any

from components.core.checkpoint.layout import step_key
from components.core.errors import CorruptCheckpoint
from components.core.storage import Store

DIGEST = "xxh3_128"
CHUNK_BYTES = 16 * 1024 * 1024  # an item is digested (and read) in pieces of at most this size
_READ_BYTES = 8 * 1024 * 1024
_IO_THREADS = max(1, min(4, os.cpu_count() or 1))


def digest(view: Any) -> str:
    """XXH3-128 of a buffer, as 32 hex digits (no copy: xxhash reads the buffer in place)."""
    import xxhash

    return xxhash.xxh3_128_hexdigest(view)


class ChunkDigests:
    """The chunk digests of one checkpoint (format 2): ``(file, offset) -> (length, digest)``."""

    def __init__(self, uri: str, files: dict[str, dict[str, Any]]):
        self.uri = uri
        self.chunks: dict[tuple[str, int], tuple[int, str]] = {}
        for name, meta in files.items():
            for offset, length, hexdigest in meta.get("chunks", []):
                self.chunks[(name, int(offset))] = (int(length), str(hexdigest))

    def expect(self, name: str, offset: int, length: int) -> str:
        """The recorded digest of the chunk of ``name`` at ``offset``; CorruptCheckpoint if the
        manifest has no chunk of exactly that extent."""
        found = self.chunks.get((name, offset))
        if found is None or found[0] != length:
            raise CorruptCheckpoint(f"{self.uri}/{name}: the manifest records no chunk of {length} bytes at "
                                    f"offset {offset} (a manifest of another checkpoint?)")
        return found[1]

    def check(self, name: str, offset: int, view: Any) -> None:
        """Raise CorruptCheckpoint unless ``view`` (the bytes read at ``offset``) has its digest."""
        if digest(view) != self.expect(name, offset, len(memoryview(view).cast("B"))):
            raise CorruptCheckpoint(f"{self.uri}/{name}: bytes {offset}..{offset + len(memoryview(view).cast('B'))} "
                                    f"do not match their {DIGEST} in the manifest (flipped bits on storage?)")


def chunk_spans(offset: int, length: int) -> list[tuple[int, int]]:
    """``(offset, length)`` pieces of at most CHUNK_BYTES covering ``[offset, offset + length)``;
    an empty item is one empty piece (it has a digest too)."""
    if length == 0:
        return [(offset, 0)]
    return [(o, min(CHUNK_BYTES, offset + length - o)) for o in range(offset, offset + length, CHUNK_BYTES)]


def check_files(store: Store, step: int, manifest: dict[str, Any]) -> None:
    """Every file of the manifest exists with its size: one listing, no data read.

    Raises:
        CorruptCheckpoint: a file is missing or has another size (truncated, partly uploaded).
    """
    key = step_key(step)
    present = store.sizes(key)
    for name, meta in manifest["files"].items():
        size = present.get(f"{key}/{name}")
        if size is None:
            raise CorruptCheckpoint(f"{store.uri_for(key)}/{name} is missing")
        if size != meta.get("size"):
            raise CorruptCheckpoint(f"{store.uri_for(key)}/{name} has {size} bytes, the manifest says "
                                    f"{meta.get('size')} (truncated?)")


def deep_verify(store: Store, step: int, manifest: dict[str, Any]) -> None:
    """Read every byte of the checkpoint and check it against the manifest (see the module doc).

    Raises:
        CorruptCheckpoint: a missing, truncated or altered file, or chunks that do not tile a file.
    """
    check_files(store, step, manifest)
    key = step_key(step)
    files = manifest["files"]
    with concurrent.futures.ThreadPoolExecutor(max(1, min(_IO_THREADS, len(files)))) as pool:
        check = _sha256_check if manifest.get("format_version") == 1 else _chunks_check
        list(pool.map(lambda name: check(store, key, name, files[name]), sorted(files)))


def _sha256_check(store: Store, key: str, name: str, meta: dict[str, Any]) -> None:
    h = hashlib.sha256()
    buf = bytearray(_READ_BYTES)
    size = int(meta["size"])
    for offset in range(0, size, _READ_BYTES):
        view = memoryview(buf)[: min(_READ_BYTES, size - offset)]
        _read(store, key, name, offset, view)
        h.update(view)
    if h.hexdigest() != meta.get("sha256"):
        raise CorruptCheckpoint(f"{store.uri_for(key)}/{name} does not match its sha256 in the manifest")


def _chunks_check(store: Store, key: str, name: str, meta: dict[str, Any]) -> None:
    digests = ChunkDigests(store.uri_for(key), {name: meta})
    covered = 0
    buf = bytearray(CHUNK_BYTES)
    for offset, length, _ in sorted(meta.get("chunks", []), key=lambda c: (c[0], c[1])):
        if offset != covered:
            raise CorruptCheckpoint(f"{store.uri_for(key)}/{name}: its chunks in the manifest leave bytes "
                                    f"{covered}..{offset} unchecked")
        if length > len(buf):
            buf = bytearray(length)
        view = memoryview(buf)[:length]
        _read(store, key, name, offset, view)
        digests.check(name, offset, view)
        covered = offset + length
    if covered != meta["size"]:
        raise CorruptCheckpoint(f"{store.uri_for(key)}/{name}: its chunks cover {covered} of {meta['size']} bytes")


def _read(store: Store, key: str, name: str, offset: int, view: memoryview) -> None:
    try:
        store.read_into(f"{key}/{name}", offset, view)
    except FileNotFoundError:
        raise CorruptCheckpoint(f"{store.uri_for(key)}/{name} is missing") from None
    except EOFError:
        raise CorruptCheckpoint(f"{store.uri_for(key)}/{name} is shorter than its manifest says (truncated?)") from None


__all__ = ["DIGEST", "CHUNK_BYTES", "ChunkDigests", "chunk_spans", "check_files", "deep_verify", "digest"]
