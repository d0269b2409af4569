"""The restore bench's raw side, untimed: a read into many buffers (a model's and an optimizer's
tensors, some never touched) returns the files' or objects' bytes front to back, checked or not."""

from __future__ import annotations

import os

import pytest
import torch

from tests.bench import rawread


def _destinations(total: int) -> list:
    """Buffers of uneven sizes summing to ``total``: pre-touched, fresh tensors, a bytearray."""
    a, b = total // 3, total // 5
    return [torch.empty(a, dtype=torch.uint8).fill_(1).numpy(), torch.empty(b, dtype=torch.uint8).numpy(),
            bytearray(total - a - b)]


@pytest.mark.parametrize("hashed", [False, True], ids=["read", "read and checked"])
def test_the_raw_reader_fills_many_buffers_with_the_bytes_of_the_files_front_to_back(tmp_path, hashed):
    blobs = [os.urandom(n) for n in (rawread.BLOCK + 4097, 10, 3 * rawread.BLOCK // 2)]
    sized = []
    for i, blob in enumerate(blobs):
        path = tmp_path / f"f{i}.bin"
        path.write_bytes(blob)
        sized.append((str(path), len(blob)))
    pieces = rawread.split(rawread.shares(sized, 1)[0], threads=2, most=rawread.BLOCK)
    into = _destinations(sum(len(b) for b in blobs))
    rawread.read_pieces(pieces, 2, into, block=1 << 16, hashed=hashed)
    assert b"".join(bytes(memoryview(d).cast("B")) for d in into) == b"".join(blobs)


def test_the_s3_baseline_fills_many_buffers_with_the_objects_bytes(s3_env):
    from relaunch.components.core.store import open_store
    from tests.bench.bench_checkpoint import _presigned

    s3_env.create_bucket("bench-restore-parts")
    store = open_store("s3://bench-restore-parts/run")
    blobs = {f"ckpt/part{i}": os.urandom(size) for i, size in enumerate([2**20 + 3, 1, 70_000])}
    for key, data in blobs.items():
        store.write_bytes(key, data)
    objects = [(f"run/{key}", len(data)) for key, data in blobs.items()]
    reader = rawread.S3Reader(s3_env.endpoint, _presigned(s3_env, "bench-restore-parts", objects), in_flight=2,
                              ranged=True, buffer=False)
    into = _destinations(sum(len(b) for b in blobs.values()))
    try:
        reader.read(into)
    finally:
        reader.close()
    assert b"".join(bytes(memoryview(d).cast("B")) for d in into) == b"".join(blobs.values())
