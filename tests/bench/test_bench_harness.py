"""The bench's own parts, untimed: the raw reader returns the files' bytes, the page-cache check
tells resident from evicted, and the S3 baseline reads what a checkpoint saved."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.bench import rawread


def _files(tmp_path: Path, sizes: list[int]) -> list[Path]:
    paths = []
    for i, size in enumerate(sizes):
        path = tmp_path / f"f{i}.bin"
        path.write_bytes(os.urandom(size))
        paths.append(path)
    return paths


def _on_tmpfs(path: Path) -> bool:
    best = ("", "")
    for line in Path("/proc/mounts").read_text().splitlines():
        mount, fstype = line.split()[1:3]
        if str(path).startswith(mount.rstrip("/") + "/") and len(mount) > len(best[0]):
            best = (mount, fstype)
    return best[1] == "tmpfs"


def test_the_raw_reader_returns_the_bytes_of_the_files_front_to_back_in_every_share(tmp_path):
    paths = _files(tmp_path, [rawread.BLOCK + 4097, 10, 3 * rawread.BLOCK // 2])
    sized = [(str(p), p.stat().st_size) for p in paths]
    whole = b"".join(p.read_bytes() for p in paths)
    for parts in (1, 3):
        got = b""
        for share in rawread.shares(sized, parts):
            pieces = rawread.split(share, threads=2, most=rawread.BLOCK)
            n = sum(p[2] for p in pieces)
            buf = rawread.prefaulted(n) if parts == 1 else rawread.part_fresh(n, n * 2 // 3)  # fresh row
            rawread.read_pieces(pieces, 2, buf)
            got += bytes(buf[:n])
        assert got == whole


def test_the_cache_check_reports_a_read_file_resident_and_an_evicted_one_not(tmp_path):
    if _on_tmpfs(tmp_path):
        pytest.skip("tmp_path is on tmpfs, whose pages cannot be evicted")
    (path,) = _files(tmp_path, [3 * 2**20 + 5])
    assert rawread.settle([path], "cold") == 0.0
    assert rawread.residency([path]) == 0.0
    assert rawread.settle([path], "warm") == 1.0
    resident, size = rawread.resident_bytes(path)
    assert resident == size
    if shutil.which("fincore"):  # util-linux's own count agrees
        out = subprocess.run(["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES", str(path)],
                             capture_output=True, text=True, check=True).stdout
        assert int(out.split()[0]) >= size


def test_our_reader_concurrency_is_found_where_the_checkpoint_package_defines_it():
    from tests.bench.bench_checkpoint import our_concurrency

    threads, in_flight = our_concurrency()
    assert threads >= 1 and in_flight >= 1


@pytest.mark.parametrize("ranged", [False, True], ids=["whole GETs", "ranged GETs"])
def test_the_s3_baseline_reads_the_bytes_of_the_objects_our_store_wrote(s3_env, ranged):
    from relaunch.components.core.store import open_store
    from tests.bench.bench_checkpoint import _presigned

    s3_env.create_bucket("bench-harness")
    store = open_store("s3://bench-harness/run")
    blobs = {f"ckpt/part{i}": os.urandom(size) for i, size in enumerate([1, 2**20 + 3, 70_000])}
    for key, data in blobs.items():
        store.write_bytes(key, data)
    objects = [(f"run/{key}", len(data)) for key, data in blobs.items()]
    reader = rawread.S3Reader(s3_env.endpoint, _presigned(s3_env, "bench-harness", objects), in_flight=2,
                               ranged=ranged)
    try:
        reader.read()
        reader.read()  # the kept-alive connections serve a second round
    finally:
        reader.close()
    assert bytes(reader.buffer) == b"".join(blobs.values())
