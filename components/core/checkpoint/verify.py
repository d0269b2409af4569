"""Is a checkpoint intact? Three depths, from cheap to full.

- :func:`checked_step`: :func:`check_files` of a checkpoint named by its URI (a ``train.resume_from``, a
  registered model's), and that it holds the task's model.
- :func:`check_files` (``latest()``): the manifest parses and every file it lists exists with its
  size. One listing of the step directory, no data read: O(1) requests whatever the size.
- the read itself (formats 2 and 3): every chunk a rank reads is checked against its XXH3-128 digest in the
  manifest as its bytes arrive (:class:`ChunkDigests`, used by ``dcp_io.StoreReader``).
- :func:`deep_verify` (``relaunch checkpoints verify --deep``): read every byte of every file. Format
  1: sha256 of each file; formats 2 and 3: every chunk digest, and the chunks must tile each file exactly.

Why XXH3-128 and not crc32c or sha256: measured on the 2-core build machine, xxhash's XXH3-128
hashes ~7 GB/s straight from a writable buffer (a tensor); google-crc32c reaches ~6 GB/s but only
accepts read-only ``bytes``, so a tensor would first be copied (~0.4 GB/s here); sha256 is ~0.8 GB/s.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import hashlib
import os
from typing import Any, Callable

from .layout import parse_checkpoint_uri, read_manifest, step_key
from ..contract.errors import BadInput, CorruptCheckpoint
from ..store import Segments, Store, open_store

DIGEST = "xxh3_128"
# An item is digested in chunks of at most this size. Reads are larger (REQUEST_BYTES) and check
# every chunk as soon as its last byte is in: a chunk is the unit a reader must read to verify,
# so a rank that needs part of an item (resharding) reads at most one chunk more at each end.
CHUNK_BYTES = 1024 * 1024
REQUEST_BYTES = 64 * 1024 * 1024  # the most one ranged read asks for
_READ_BYTES = 8 * 1024 * 1024  # format 1 deep verify: sha256 of each file in pieces of this size
_IO_THREADS = max(1, min(4, os.cpu_count() or 1))


def digest(view: Any) -> str:
    """XXH3-128 of a buffer, as 32 hex digits (no copy: xxhash reads the buffer in place)."""
    import xxhash

    return xxhash.xxh3_128_hexdigest(view)


class ChunkDigests:
    """The chunk digests of one checkpoint (formats 2 and 3), per file sorted by offset."""

    def __init__(self, uri: str, files: dict[str, dict[str, Any]]):
        self.uri = uri
        self.files: dict[str, list[tuple[int, int, str]]] = {}
        self.starts: dict[str, list[int]] = {}
        for name, meta in files.items():
            # an empty item has an empty chunk: nothing to read or check, and it would share
            # its offset with the next item's first chunk
            chunks = sorted((int(o), int(n), str(h)) for o, n, h in meta.get("chunks", []) if int(n))
            self.files[name] = chunks
            self.starts[name] = [c[0] for c in chunks]

    def covering(self, name: str, start: int, end: int) -> list[tuple[int, int, str]]:
        """The recorded chunks, in order, that tile the smallest range covering ``[start, end)`` of
        ``name`` (``end > start``); CorruptCheckpoint when the manifest's chunks leave a gap there."""
        chunks, starts = self.files.get(name, []), self.starts.get(name, [])
        i = bisect.bisect_right(starts, start) - 1
        out: list[tuple[int, int, str]] = []
        at = -1
        while 0 <= i < len(chunks) and (at < 0 or at < end):
            off, n, _ = chunks[i]
            if at >= 0 and off != at:
                break
            out.append(chunks[i])
            at = off + n
            i += 1
        if not out or out[0][0] + out[0][1] <= start or at < end:
            raise CorruptCheckpoint(f"{self.uri}/{name}: the manifest records no chunks covering bytes "
                                    f"{start}..{end} (a manifest of another checkpoint?)")
        return out

    def check(self, name: str, offset: int, view: Any) -> None:
        """Raise CorruptCheckpoint unless ``view`` (the bytes read at ``offset``) is exactly one
        recorded chunk with its digest."""
        length = len(memoryview(view).cast("B"))
        if not length:
            return
        i = bisect.bisect_left(self.starts.get(name, []), offset)
        chunks = self.files.get(name, [])
        if i >= len(chunks) or chunks[i][0] != offset or chunks[i][1] != length:
            raise CorruptCheckpoint(f"{self.uri}/{name}: the manifest records no chunk of {length} bytes at "
                                    f"offset {offset} (a manifest of another checkpoint?)")
        if digest(view) != chunks[i][2]:
            raise self.mismatch(name, offset, length)

    def mismatch(self, name: str, offset: int, length: int) -> CorruptCheckpoint:
        return CorruptCheckpoint(f"{self.uri}/{name}: bytes {offset}..{offset + length} do not match their "
                                 f"{DIGEST} in the manifest (flipped bits on storage?)")

    def read(self, store: Store, key: str, name: str, start: int, buffer: Any) -> None:
        """One ranged read of ``name`` from ``start`` into ``buffer`` (a buffer or a list of them),
        which must cover whole recorded chunks, each checked as soon as its last byte arrives.

        Raises:
            CorruptCheckpoint: a chunk does not match, the file is missing or shorter.
        """
        verifier = _Verifier(self, name, start, buffer)
        if not verifier.total:
            return
        try:
            store.read_into(f"{key}/{name}", start, buffer, sink=verifier)
        except FileNotFoundError:
            raise CorruptCheckpoint(f"{self.uri}/{name} is missing") from None
        except EOFError:
            raise CorruptCheckpoint(f"{self.uri}/{name} is shorter than the manifest says (truncated?)") from None
        if verifier.next < len(verifier.chunks):
            raise CorruptCheckpoint(f"{self.uri}/{name}: bytes {start}..{start + verifier.total} were not all read")


class _Verifier:
    """``sink`` of a ranged read: feeds each block that arrived to its chunk's digest while the block
    is still in the CPU cache, and compares each chunk's digest once its last byte is in."""

    def __init__(self, digests: ChunkDigests, name: str, start: int, buffer: Any):
        import xxhash

        self.digests, self.name, self.start = digests, name, start
        self.segments = Segments(buffer)
        self.total = self.segments.total
        self.chunks = digests.covering(name, start, start + self.total) if self.total else []
        if self.total and (self.chunks[0][0] != start or sum(c[1] for c in self.chunks) != self.total):
            raise CorruptCheckpoint(f"{digests.uri}/{name}: bytes {start}..{start + self.total} are not whole "
                                    f"chunks of the manifest (a manifest of another checkpoint?)")
        self.hasher = xxhash.xxh3_128()
        self.next = 0  # the chunk being digested
        self.hashed = 0  # bytes of the range fed to the digests so far

    def __call__(self, filled: int) -> None:
        if filled == 0 or filled < self.hashed:  # a retried request starts over
            self.next, self.hashed = 0, 0
            self.hasher.reset()
        while self.next < len(self.chunks) and self.hashed < filled:
            off, n, expected = self.chunks[self.next]
            chunk_end = off - self.start + n
            upto = min(filled, chunk_end)
            for view in self.segments.slices(self.hashed, upto - self.hashed):
                self.hasher.update(view)
            self.hashed = upto
            if upto < chunk_end:
                return
            if self.hasher.hexdigest() != expected:
                raise self.digests.mismatch(self.name, off, n)
            self.hasher.reset()
            self.next += 1


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
    size = int(meta["size"])
    covered = 0
    for offset, length, _ in digests.files[name]:
        if offset != covered:
            raise CorruptCheckpoint(f"{store.uri_for(key)}/{name}: its chunks in the manifest leave bytes "
                                    f"{covered}..{offset} unchecked")
        covered = offset + length
    if covered != size:
        raise CorruptCheckpoint(f"{store.uri_for(key)}/{name}: its chunks cover {covered} of {size} bytes")
    buf = bytearray(min(size, REQUEST_BYTES) or 1)
    at, chunks = 0, digests.files[name]
    while at < len(chunks):  # requests of whole chunks, up to REQUEST_BYTES (at least one chunk)
        first, n = chunks[at][0], 0
        while at < len(chunks) and (n == 0 or n + chunks[at][1] <= REQUEST_BYTES):
            n += chunks[at][1]
            at += 1
        if n > len(buf):
            buf = bytearray(n)
        digests.read(store, key, name, first, memoryview(buf)[:n])


def _read(store: Store, key: str, name: str, offset: int, view: memoryview) -> None:
    try:
        store.read_into(f"{key}/{name}", offset, view)
    except FileNotFoundError:
        raise CorruptCheckpoint(f"{store.uri_for(key)}/{name} is missing") from None
    except EOFError:
        raise CorruptCheckpoint(f"{store.uri_for(key)}/{name} is shorter than its manifest says (truncated?)") from None


__all__ = ["DIGEST", "CHUNK_BYTES", "REQUEST_BYTES", "ChunkDigests", "chunk_spans", "check_files", "deep_verify", "digest"]


def checked_step(uri: str, fingerprint: Callable[[], str] | None = None) -> int:
    """The step of the committed checkpoint at ``uri``, after an O(1) check (manifest, files and
    sizes); with ``fingerprint``, also that it holds the model this task builds.

    Raises:
        BadInput: not a committed relaunch checkpoint (or unreadable), or another model.
    """
    store_uri, step = parse_checkpoint_uri(uri)
    store = open_store(store_uri)
    try:
        manifest = read_manifest(store, step)
        check_files(store, step, manifest)
    except (CorruptCheckpoint, FileNotFoundError) as err:
        raise BadInput(f"train.resume_from: {uri!r} is not a committed relaunch checkpoint ({err})") from None
    theirs = manifest.get("model_fingerprint")
    if fingerprint is not None and theirs:
        mine = fingerprint()
        if theirs != mine:
            raise BadInput(f"train.resume_from: {uri!r} holds another model (fingerprint {theirs}, the task "
                           f"builds {mine}); check train.task and its sizes")
    return step
