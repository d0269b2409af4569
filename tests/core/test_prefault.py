"""Populating a load's fresh memory beside its planning (components/core/checkpoint/prefault.py), with
real memory: the pages become resident, no byte changes, even with a writer at work in the same tensor."""

from __future__ import annotations

import mmap
import os
import platform
import re
import sys
import threading

import pytest
import torch

from relaunch.components.core.checkpoint import prefault

_release = re.match(r"(\d+)\.(\d+)", platform.release())
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or not _release
                                or tuple(map(int, _release.groups())) < (5, 14),
                                reason="MADV_POPULATE_WRITE is Linux's, from 5.14")
MIB = 1 << 20


def _resident_bytes(tensor: torch.Tensor) -> int:
    """Bytes of ``tensor``'s whole pages that are present in memory (from /proc/self/pagemap's bit 63)."""
    page = os.sysconf("SC_PAGE_SIZE")
    address, nbytes = prefault.page_range(tensor.data_ptr(), tensor.numel() * tensor.element_size(), page)
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(address // page * 8)
        entries = f.read(nbytes // page * 8)
    present = sum(1 for i in range(0, len(entries), 8) if entries[i + 7] & 0x80)
    return present * page


def test_page_range_takes_only_the_whole_pages_inside():
    assert prefault.page_range(4096, 8192, 4096) == (4096, 8192)
    assert prefault.page_range(4097, 8192, 4096) == (8192, 4096)
    assert prefault.page_range(100, 200, 4096)[1] == 0


def test_populated_pages_of_a_fresh_tensor_are_resident_and_what_was_written_stays():
    # a mapping of its own: malloc may hand out memory a test before this one in the process had touched
    fresh = torch.frombuffer(mmap.mmap(-1, 64 * MIB), dtype=torch.uint8)
    before = _resident_bytes(fresh)
    fresh[: 8 * MIB] = 7  # a reader got there first
    assert prefault.populate([fresh]) >= 63 * MIB
    assert before == 0
    assert _resident_bytes(fresh) >= 63 * MIB
    assert torch.all(fresh[: 8 * MIB] == 7)
    assert torch.all(fresh[8 * MIB:] == 0)


def test_a_background_populate_beside_a_writer_never_changes_a_byte():
    tensors = [torch.empty(8 * MIB, dtype=torch.uint8) for _ in range(16)]
    writer_done = threading.Event()

    def write() -> None:  # the reads: first to last, as the load fills them
        for i, t in enumerate(tensors):
            t.fill_(i + 1)
        writer_done.set()

    thread = prefault.populate_in_background(tensors)
    write()
    if thread is not None:
        thread.join(30)
        assert not thread.is_alive()
    assert writer_done.is_set()
    assert all(torch.all(t == i + 1) for i, t in enumerate(tensors))


def test_a_payload_made_on_another_thread_is_zeros_with_its_pages_resident():
    """The memory tier's buffers made off the main thread (a peer's put, a snapshot) are populated by the
    kernel rather than by a threaded fill: still all zeros, every whole page present."""
    from relaunch.components.core.recovery.packing import new_payload

    made: list = []
    worker = threading.Thread(target=lambda: made.append(new_payload(64 * MIB)))
    worker.start()
    worker.join()
    payload = torch.from_numpy(made[0])
    assert payload.numel() == 64 * MIB and not payload.any()
    whole = prefault.page_range(payload.data_ptr(), payload.numel(), os.sysconf("SC_PAGE_SIZE"))[1]
    assert _resident_bytes(payload) == whole
