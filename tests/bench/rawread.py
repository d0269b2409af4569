"""The raw side of the checkpoint bench: this machine's limit for reading the same bytes, without
relaunch's code (stdlib only, so that a reader process starts in milliseconds), and the page-cache
state of files (``mincore`` on a mapping, the call ``fincore`` makes).

A reader reads ``pieces`` (path, offset, length), each front to back with ``os.preadv`` in blocks of
``block`` bytes (the bench tries each of BLOCKS and keeps the best), ``threads`` pieces at a time, into one buffer allocated and page-faulted before the timed
region. Run as ``python -m tests.bench.rawread SPEC.json`` it is one reader process of a group (the
raw side of an N-rank restore): it prepares, prints ``ready``, waits for a line on stdin, reads, and
prints ``{"start": ..., "end": ...}`` (time.monotonic, comparable across processes). With ``fresh``
in the spec (a fraction), that fraction of its buffer is never touched before the read (see
``part_fresh``): the measured row of what faulting fresh memory adds.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import ctypes
import http.client
import json
import mmap
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterable

BLOCK = 8 << 20
BLOCKS = (512 << 10, 8 << 20)  # measured here: small blocks read a cold file faster, large ones a warm one
PAGE = os.sysconf("SC_PAGE_SIZE")
_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
_LOW_BIT = bytes(b & 1 for b in range(256))  # mincore defines only the lowest bit of each entry

Piece = tuple[str, int, int]


def resident_bytes(path: str | os.PathLike) -> tuple[int, int]:
    """(bytes of ``path`` in the page cache, size of ``path``), by ``mincore`` on a private mapping
    (which maps the file's cached pages and faults none in)."""
    size = os.path.getsize(path)
    if not size:
        return 0, 0
    with open(path, "rb") as fh:
        mm = mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_COPY)
    try:
        anchor = ctypes.c_char.from_buffer(mm)
        try:
            pages = -(-size // PAGE)
            vec = (ctypes.c_ubyte * pages)()
            if _LIBC.mincore(ctypes.addressof(anchor), size, vec):
                err = ctypes.get_errno()
                raise OSError(err, f"mincore {path}: {os.strerror(err)}")
            hits = bytes(vec).translate(_LOW_BIT).count(1)
        finally:
            del anchor
    finally:
        mm.close()
    return hits * PAGE - (pages * PAGE - size if vec[pages - 1] & 1 else 0), size


def residency(paths: Iterable[str | os.PathLike]) -> float:
    """The fraction of the bytes of ``paths`` that are in the page cache (1.0 for no bytes)."""
    hit = total = 0
    for path in paths:
        h, n = resident_bytes(path)
        hit, total = hit + h, total + n
    return hit / total if total else 1.0


def evict(paths: Iterable[str | os.PathLike]) -> None:
    """Write back and drop the cached pages of ``paths``: the next read comes from the disk."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm(paths: Iterable[str | os.PathLike]) -> None:
    """Read ``paths`` through once, so that they are in the page cache."""
    scratch = bytearray(BLOCK)
    for path in paths:
        with open(path, "rb", buffering=0) as fh:
            while fh.readinto(scratch):
                pass


def settle(paths: list, cache: str, tries: int = 4) -> float:
    """Bring ``paths`` to the cache state ``cache`` ("warm": all resident, "cold": none) and return
    the resident fraction measured right after (the caller reports it beside the timing)."""
    fraction = residency(paths)
    for _ in range(tries):
        if cache == "warm" and fraction >= 1.0 or cache == "cold" and fraction <= 0.0:
            break
        (warm if cache == "warm" else evict)(paths)
        fraction = residency(paths)
    return fraction


def prefaulted(nbytes: int) -> bytearray:
    """A buffer of ``nbytes`` whose every page is written once (so faulted in) before it is used."""
    buf = bytearray(max(1, nbytes))
    ctypes.memset((ctypes.c_char * len(buf)).from_buffer(buf), 0x5A, len(buf))
    return buf


def shares(files: list[tuple[str, int]], parts: int) -> list[list[Piece]]:
    """The bytes of ``files`` (path, size), front to back, cut into ``parts`` shares of equal size
    (to the byte), each a list of (path, offset, length) pieces of at most one file each."""
    total = sum(size for _, size in files)
    bounds = [total * i // parts for i in range(parts + 1)]
    out: list[list[Piece]] = [[] for _ in range(parts)]
    at = 0
    for path, size in files:
        for i in range(parts):
            lo, hi = max(bounds[i], at), min(bounds[i + 1], at + size)
            if hi > lo:
                out[i].append((str(path), lo - at, hi - lo))
        at += size
    return out


def split(pieces: list[Piece], threads: int, most: int = 64 << 20, slack: int = (64 << 20) // 16) -> list[Piece]:
    """``pieces`` cut so that each is at most ``most`` bytes (our reader's largest single read) and
    ``threads`` threads all have one to read (one file alone is read by every thread, as ours may).
    A piece at most ``slack`` past the cap stays whole, as our reader reads a file whole that is a
    little more than its request cap (a 64 MiB file of tensors plus its archive records)."""
    total = sum(p[2] for p in pieces)
    cap = max(BLOCK, min(most, -(-total // max(1, threads))))
    cap = -(-cap // BLOCK) * BLOCK
    whole = cap + slack if cap >= most else cap
    return [(path, offset + at, min(cap, length - at)) if length > whole else (path, offset, length)
            for path, offset, length in pieces
            for at in (range(0, length, cap) if length > whole else (0,))]


class Scatter:
    """Writable buffers filled one after another as if they were one (the destination of a read into
    many tensors: a restore's model and optimizer state)."""

    def __init__(self, buffers: Any):
        views = [memoryview(b).cast("B") for b in (buffers if isinstance(buffers, (list, tuple)) else [buffers])]
        self.views = [v for v in views if len(v)]
        self.starts = [0]
        for v in self.views:
            self.starts.append(self.starts[-1] + len(v))
        self.total = self.starts[-1]

    def slices(self, start: int, length: int) -> list[memoryview]:
        """Views of the bytes ``[start, start + length)`` of the whole, one per buffer they touch."""
        out, end = [], start + length
        i = bisect.bisect_right(self.starts, start) - 1
        while start < end:
            lo = start - self.starts[i]
            take = min(end, self.starts[i + 1]) - start
            out.append(self.views[i][lo:lo + take])
            start += take
            i += 1
        return out


def read_pieces(pieces: list[Piece], threads: int, buf: Any, block: int = BLOCK, hashed: bool = False) -> None:
    """Read every piece, each front to back by one thread in ``block``-byte reads, ``threads`` at a
    time, into ``buf`` (a buffer, or a list of buffers filled one after another) one after another
    (pieces in order). ``hashed``: each block fed to an XXH3-128 of its piece right after it is read
    (the integrity check ours makes, by the same library, while the block is in the CPU cache)."""
    if hashed:
        import xxhash  # the only non-stdlib import here, and only for this variant
    view = Scatter(buf)
    jobs, at = [], 0
    for piece in pieces:
        jobs.append((piece, at))
        at += piece[2]
    if at > view.total:
        raise ValueError(f"buffer of {view.total} bytes for {at} bytes of pieces")

    def read(job: tuple[Piece, int]) -> None:
        (path, offset, length), pos = job
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_SEQUENTIAL)
            done = 0
            hasher = xxhash.xxh3_128() if hashed else None
            while done < length:
                n = os.preadv(fd, view.slices(pos + done, min(length - done, block)), offset + done)
                if not n:
                    raise EOFError(f"{path} ends at {offset + done}")
                if hasher is not None:
                    for v in view.slices(pos + done, n):
                        hasher.update(v)
                done += n
        finally:
            os.close(fd)

    with concurrent.futures.ThreadPoolExecutor(max(1, threads)) as pool:
        list(pool.map(read, jobs))


class S3Reader:
    """GETs whole objects from an S3 endpoint with plain ``http.client``, ``in_flight`` at a time
    (``ranged``: each as the range of all its bytes, as our reader asks),
    each on its own kept-alive connection made before the timed region, straight from the socket into
    one pre-faulted buffer. ``objects`` are (request path, size): presigned paths (query-string
    authentication, signed before the timed region by an independent client such as boto3)."""

    def __init__(self, endpoint: str, objects: list[tuple[str, int]], in_flight: int, ranged: bool = False,
                 buffer: bool = True):
        host = endpoint.split("://", 1)[-1].rstrip("/")
        self.objects, self.in_flight, self.ranged = objects, max(1, in_flight), ranged
        # buffer=False: no buffer of its own; every read() names its destination
        self.buffer = prefaulted(sum(size for _, size in objects)) if buffer else None
        self._conns = [http.client.HTTPConnection(host, timeout=120) for _ in range(self.in_flight)]
        for conn in self._conns:
            conn.connect()
        self._free = list(self._conns)
        self._lock = threading.Lock()

    def read(self, into: Any = None) -> None:
        """One GET per object, all of them, into the buffer (or ``into``: buffers filled one after
        another, e.g. memory as fresh as a restarted training's)."""
        view = Scatter(self.buffer if into is None else into)
        jobs, at = [], 0
        for name, size in self.objects:
            jobs.append((name, size, at))
            at += size

        def get(job: tuple[str, int, int]) -> None:
            name, size, pos = job
            with self._lock:
                conn = self._free.pop()
            try:
                conn.request("GET", name, headers={"Range": f"bytes=0-{size - 1}"} if self.ranged and size else {})
                resp = conn.getresponse()
                if resp.status not in (200, 206):
                    raise OSError(f"GET {name.split('?')[0]}: HTTP {resp.status} {resp.read(300)!r}")
                done = 0
                for piece in view.slices(pos, size):
                    filled = 0
                    while filled < len(piece):
                        n = resp.readinto(piece[filled:])
                        if not n:
                            raise EOFError(f"{name} ended at byte {done + filled} of {size}")
                        filled += n
                    done += filled
                if resp.read(1):
                    raise OSError(f"{name} is longer than {size} bytes")
            finally:
                with self._lock:
                    self._free.append(conn)

        with concurrent.futures.ThreadPoolExecutor(self.in_flight) as pool:
            list(pool.map(get, jobs))

    def close(self) -> None:
        for conn in self._conns:
            conn.close()


def part_fresh(nbytes: int, fresh: int) -> mmap.mmap:
    """A buffer of ``nbytes`` whose first ``nbytes - fresh`` bytes are page-faulted and whose last
    ``fresh`` bytes are anonymous memory never touched (each page faults when the read fills it)."""
    buf = mmap.mmap(-1, max(1, nbytes))
    done = max(0, nbytes - fresh)
    if done:
        ctypes.memset((ctypes.c_char * done).from_buffer(buf), 0x5A, done)
    return buf


def _child(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    pieces = [tuple(p) for p in spec["pieces"]]
    nbytes = sum(p[2] for p in pieces)
    buf = part_fresh(nbytes, int(spec["fresh"] * nbytes)) if spec.get("fresh") else prefaulted(nbytes)
    print("ready", flush=True)
    sys.stdin.readline()
    start = time.monotonic()
    read_pieces(split(pieces, spec["threads"]), spec["threads"], buf, spec.get("block", BLOCK))
    print(json.dumps({"start": start, "end": time.monotonic(), "bytes": sum(p[2] for p in pieces)}), flush=True)


if __name__ == "__main__":
    _child(sys.argv[1])
