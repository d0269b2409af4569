"""Memory a load is about to read into, made resident beside the work that comes before the read.

A restarted training's load reads most of its bytes (the optimizer's moments) into memory allocated
for it and never touched: each page faults inside the read's copy, which on this machine made such a
read ~3x slower than one into touched memory (``make bench ARGS=restore``). Between the allocation and
the first read, the load spends its time in Python (locating, checking, planning) on one core;

    background = populate_in_background(tensors)   # right after the allocation
    ...                                            # locate, plan: the pages are populated meanwhile

asks the kernel on a thread of its own to populate the tensors' pages (Linux's
``madvise(MADV_POPULATE_WRITE)``, 5.14+): each page is made present and writable as a fault would, and
a page that is present already (a read got there first) is left as it is, so the thread never changes a
byte and may run on beside the reads. The tensors are taken last first (the reads fill them first to last,
so the two meet once). Where the call is not available (another OS, an older kernel) nothing happens.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from typing import Any, Iterable

MADV_POPULATE_WRITE = 23  # <linux/mman.h>, Linux 5.14
_available = sys.platform.startswith("linux")


def _madvise() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc.madvise


def page_range(address: int, nbytes: int, page: int) -> tuple[int, int]:
    """The whole pages inside ``[address, address + nbytes)``: (first page's address, bytes), which
    is (x, 0) when no whole page lies inside (a partial page is left to fault as it would)."""
    lo = -(-address // page) * page
    hi = (address + nbytes) // page * page
    return lo, max(0, hi - lo)


def populate(tensors: Iterable[Any]) -> int:
    """Populate the whole pages of each CPU tensor of ``tensors``, in the order given; bytes populated
    (0 where the kernel does not offer it)."""
    global _available
    if not _available:
        return 0
    madvise, page, done = _madvise(), os.sysconf("SC_PAGE_SIZE"), 0
    for tensor in tensors:
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            continue
        address, nbytes = page_range(tensor.data_ptr(), tensor.numel() * tensor.element_size(), page)
        if nbytes and madvise(address, nbytes, MADV_POPULATE_WRITE) == 0:
            done += nbytes
        elif nbytes and ctypes.get_errno() == 22:  # EINVAL: a kernel before 5.14 (or no such advice)
            _available = False
            return done
    return done


def populate_in_background(tensors: list[Any]) -> threading.Thread | None:
    """:func:`populate` of ``tensors``, last first, on a daemon thread (started; None when there is
    nothing to do). The caller keeps the tensors alive; it need not wait for the thread."""
    cpu = [t for t in tensors if t.device.type == "cpu" and t.numel()]
    if not _available or not cpu:
        return None
    thread = threading.Thread(target=populate, args=(cpu[::-1],), name="relaunch-populate", daemon=True)
    thread.start()
    return thread
