"""Transient storage faults: a TCP proxy between the S3 client and the real S3 server resets >= 10 %
of connections and answers some requests 503 SlowDown; every save still commits, every checkpoint
verifies, and the time lost to retries is reported."""

from __future__ import annotations

import time

import pytest

from relaunch.components.core.store import s3 as s3_backend
from relaunch.components.core.checkpoint import CheckpointManager
from tests.core.faults import FaultProxy
from tests.core.helpers import make_state, s3_root, train_steps


def _saves(root: str, n: int) -> tuple[float, CheckpointManager]:
    mgr = CheckpointManager(root, keep_last=2, owner="fault-test")
    state = make_state(width=64)
    started = time.perf_counter()
    for step in range(1, n + 1):
        train_steps(state, 1)
        mgr.save(step, state)
        assert mgr.wait().step == step
    return time.perf_counter() - started, mgr


@pytest.mark.slow
def test_every_save_commits_through_resets_and_slowdowns(s3_env, monkeypatch, tmp_path):
    root = s3_root(s3_env, "faults")
    monkeypatch.setenv("RELAUNCH_STORE_BACKOFF", "0.02")
    monkeypatch.setenv("RELAUNCH_STORE_RETRIES", "12")
    # a 6 MiB file goes multipart in 5 MiB parts, so part retries are exercised too
    monkeypatch.setattr(s3_backend, "MULTIPART_THRESHOLD", 5 * 1024 * 1024)
    monkeypatch.setattr(s3_backend, "PART_SIZE", 5 * 1024 * 1024)
    clean_seconds, clean = _saves(root + "-clean", 8)
    clean.close()

    proxy = FaultProxy(s3_env.port, p_reset=0.12, p_reset_after=0.03, p_slowdown=0.08, seed=7).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    try:
        faulty_seconds, mgr = _saves(root, 8)
        big = tmp_path / "big.bin"
        big.write_bytes(bytes(range(256)) * (6 * 1024 * 1024 // 256))
        mgr.store.upload_file("blobs/big.bin", big)
        mgr.store.download_file("blobs/big.bin", tmp_path / "back.bin")
        assert (tmp_path / "back.bin").read_bytes() == big.read_bytes()
        for info in mgr.list():
            mgr.verify(info.step)
        assert mgr.latest().step == 8
        stats = dict(mgr.store.stats)
        mgr.close()
    finally:
        proxy.stop()
    counts = proxy.counts
    resets = counts["reset"] + counts["reset_after"]
    assert resets / counts["connections"] >= 0.10, counts
    assert counts["slowdown"] > 0 and stats["retries"] > 0
    print(f"\nfault proxy: {dict(counts)}; client retries {stats['retries']}, "
          f"backoff sleep {stats['retry_seconds']:.2f}s; 8 saves took {faulty_seconds:.2f}s vs "
          f"{clean_seconds:.2f}s clean: time lost {faulty_seconds - clean_seconds:.2f}s")
