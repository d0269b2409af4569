"""The data bench's own parts, untimed: the RSS reader sums a process and the processes under it, the
synthetic dataset writer makes the dataset it says, the window boundary is where the loader first
needs new shards, and the dataset is scaled to the disk."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from tests.bench import bench_data


def test_the_rss_reader_sums_a_process_and_its_children_peaks(tmp_path):
    hold = "import sys; x = b'\\x01' * (48 << 20); print('ready', flush=True); sys.stdin.readline()"
    parent = subprocess.Popen(
        [sys.executable, "-c",
         "import subprocess, sys\n"
         f"child = subprocess.Popen([sys.executable, '-c', {hold!r}], stdin=subprocess.PIPE, stdout=subprocess.PIPE)\n"
         "child.stdout.readline()\n"
         f"exec({hold!r})\n"
         "child.communicate(b'\\n')\n"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout.readline().strip() == "ready"  # and its child is ready before it
        peaks = bench_data.peak_rss_tree(parent.pid)
    finally:
        parent.communicate("\n", timeout=60)
    assert parent.pid in peaks and len(peaks) == 2
    assert all(peak >= 48 << 20 for peak in peaks.values())  # each holds its 48 MiB of written pages
    assert bench_data.vm_hwm(parent.pid) == 0  # gone: nothing to count


def test_the_synthetic_writer_commits_the_token_rows_it_says_in_distinct_shards(tmp_path):
    from relaunch.components.core.data.shards import iter_rows, read_manifest
    from relaunch.components.core.store import open_store
    from relaunch.components.tasks.lm import VOCAB_SIZE

    store = open_store(str(tmp_path / "store"))
    seq_len, shard_bytes = 15, 500  # rows of 16 bytes (uint8 tokens), 31 a shard
    manifest, written = bench_data.write_synthetic(store, 2500, seq_len=seq_len, seed=3, shard_bytes=shard_bytes)
    assert read_manifest(store, manifest.version).version == manifest.version
    shards = manifest.split("train")
    assert manifest.samples("train") == 2500 // 16
    assert [s.samples for s in shards] == [31] * 5 + [1]
    assert len({s.digest for s in shards}) == len(shards) and written == len(shards) + 1  # and the manifest
    rows = np.concatenate(list(iter_rows(store, manifest, "train")))["tokens"]
    assert rows.shape == (156, seq_len + 1) and rows.dtype == np.uint8 and int(rows.max()) < VOCAB_SIZE
    assert sorted(set(rows[:, 0].tolist())) == list(range(len(shards)))  # each shard's rows stamped with its number
    files = bench_data.shard_files(str(tmp_path / "store"), manifest)
    assert sum((tmp_path / f).stat().st_size for f in files) == 156 * 16


def test_the_window_boundary_is_the_first_step_that_reads_a_shard_outside_the_first_window():
    from relaunch.components.core.data.order import WINDOW_SHARDS, GlobalOrder, rank_positions

    counts, seed, batch = [40, 40, 37, 40, 40, 40, 12], 5, 4
    boundary = bench_data.window_boundary(counts, seed, batch)
    order = GlobalOrder(counts, seed)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])

    def shards(steps: range) -> set[int]:
        index = np.concatenate([order.indices(0, rank_positions(s, batch, 0, 1)) for s in steps])
        return set((np.searchsorted(starts, index, side="right") - 1).tolist())

    before = shards(range(boundary))
    assert len(before) == WINDOW_SHARDS
    assert not shards(range(boundary, boundary + 1)) <= before


def test_the_dataset_is_scaled_down_to_what_the_disk_holds_with_its_margin():
    gib = 1 << 30
    assert bench_data.fit_to_disk(2 * gib, 50 * gib, bench_data.disk_margin(50 * gib)) == 2 * gib
    assert bench_data.fit_to_disk(2 * gib, 3 * gib, bench_data.disk_margin(3 * gib)) == gib
    assert bench_data.fit_to_disk(2 * gib, gib, bench_data.disk_margin(gib)) == 0


def test_the_row_groups_named_are_run_with_prepare_and_an_unknown_name_is_refused():
    assert bench_data.rows_wanted("") == set(bench_data.ROW_GROUPS)
    assert bench_data.rows_wanted("resume, steps") == {"prepare", "resume", "steps"}
    with pytest.raises(ValueError, match="no row group prepar; name some of steps, memory, prepare, resume"):
        bench_data.rows_wanted("prepar")


def test_the_disk_floor_writes_each_payload_to_a_file_of_its_own(tmp_path):
    seconds = bench_data.disk_write([b"a" * 10, b"", b"bc"], tmp_path / "floor")
    assert seconds > 0
    assert [(tmp_path / "floor" / f"{i}.bin").read_bytes() for i in range(3)] == [b"a" * 10, b"", b"bc"]
