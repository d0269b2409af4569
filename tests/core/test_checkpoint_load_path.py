"""The load path: tensors read straight into their destination, items cut into digested chunks,
several files per rank for a large state, no staging copy on S3 (ranged reads of exactly the bytes
needed), and changed bytes caught by the read that loads them."""

from __future__ import annotations

import os
import time

import pytest
import torch

import relaunch.components.core.checkpoint.commit as commit
import relaunch.components.core.checkpoint.load as load
import relaunch.components.core.checkpoint.verify as verify
from relaunch.components.core.checkpoint import CheckpointManager, step_key
from relaunch.components.core.contract.errors import CorruptCheckpoint
from relaunch.components.core.store import open_store
from tests.core.helpers import make_state, train_steps

TENSORS = {
    "float32 matrix": torch.randn(5, 7),
    "bfloat16 vector": torch.randn(33).to(torch.bfloat16),
    "int64 counter (0-dim)": torch.tensor(12345, dtype=torch.int64),
    "bool mask": torch.rand(3, 4) > 0.5,
    "empty tensor": torch.empty(0, 3),
    "float64 4-d": torch.randn(2, 3, 2, 2, dtype=torch.float64),
}


def _save(root, state, step=1):
    with CheckpointManager(root, owner="load-path-test", async_save=False) as mgr:
        mgr.save(step, state)


@pytest.mark.parametrize("chunk_bytes", [verify.CHUNK_BYTES, 7], ids=["one chunk per item", "7-byte chunks"])
def test_every_dtype_and_shape_loads_back_bitwise_into_existing_tensors(tmp_path, monkeypatch, chunk_bytes):
    monkeypatch.setattr(verify, "CHUNK_BYTES", chunk_bytes)
    root = str(tmp_path / "store")
    _save(root, {"t": dict(TENSORS)})
    target = {"t": {k: torch.zeros_like(v) for k, v in TENSORS.items()}}
    keep = {k: v for k, v in target["t"].items()}
    CheckpointManager(root).load(target)
    for name, original in TENSORS.items():
        assert target["t"][name].dtype == original.dtype and torch.equal(target["t"][name], original), name
        assert target["t"][name].data_ptr() == keep[name].data_ptr() or original.numel() == 0, name


def test_a_non_contiguous_destination_is_filled_correctly(tmp_path):
    root = str(tmp_path / "store")
    source = torch.arange(12.0).reshape(3, 4)
    _save(root, {"w": source})
    holder = torch.zeros(4, 3)
    target = {"w": holder.t()}  # a transposed view: not contiguous, so not read in place
    CheckpointManager(root).load(target)
    assert torch.equal(target["w"], source)


def test_a_large_state_is_split_into_several_files_per_rank_and_loads_back(tmp_path, monkeypatch):
    monkeypatch.setattr(commit, "FILE_BYTES", 8192)
    monkeypatch.setattr(load, "IO_THREADS", 2)
    root = str(tmp_path / "store")
    state = make_state(width=64)
    train_steps(state, 2)
    _save(root, state, step=2)
    names = set(open_store(root).list(step_key(2) + "/"))
    assert {f"{step_key(2)}/__0_0.distcp", f"{step_key(2)}/__0_1.distcp"} <= names
    fresh = make_state(seed=9, width=64)
    CheckpointManager(root).load(fresh)
    assert all(torch.equal(a, b) for a, b in zip(fresh.model.parameters(), state.model.parameters()))


def _flip_in_place(path):
    time.sleep(0.05)  # a later modification time than the save's, whatever the clock's granularity
    with open(path, "r+b") as fh:
        fh.seek(os.path.getsize(path) // 2)
        byte = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([byte[0] ^ 0xFF]))


def test_a_shard_altered_in_place_after_latest_is_caught_by_load(tmp_path):
    root = str(tmp_path / "store")
    state = make_state()
    with CheckpointManager(root, keep_last=0, owner="load-path-test") as mgr:
        mgr.save(1, state)
        mgr.wait()
        train_steps(state, 1)
        mgr.save(2, state)
    reader = CheckpointManager(root)
    assert reader.latest().step == 2  # manifest, files and sizes: no byte read here
    _flip_in_place(open_store(root).path(f"{step_key(2)}/__0_0.distcp"))
    with pytest.raises(CorruptCheckpoint, match="xxh3_128"):
        reader.load(make_state(seed=3), step=2)
    assert reader.load(make_state(seed=3)).step == 1  # and locate falls back
    reader.close()


def test_a_load_checks_the_manifest_once_and_agrees_once_on_what_to_read(tmp_path, monkeypatch):
    root = str(tmp_path / "store")
    state = make_state(width=16)
    _save(root, state, step=3)
    mgr = CheckpointManager(root)
    reads: list[str] = []
    listings: list[str] = []
    agreements: list[object] = []
    read_bytes, sizes, agree = mgr.store.read_bytes, mgr.store.sizes, mgr.ranks.agree
    monkeypatch.setattr(mgr.store, "read_bytes", lambda key: reads.append(key) or read_bytes(key))
    monkeypatch.setattr(mgr.store, "sizes", lambda prefix: listings.append(prefix) or sizes(prefix))
    monkeypatch.setattr(mgr.ranks, "agree", lambda outcome, **kw: agreements.append(outcome) or agree(outcome, **kw))
    fresh = make_state(seed=5, width=16)
    assert mgr.load(fresh).step == 3
    mgr.close()
    assert all(torch.equal(a, b) for a, b in zip(fresh.model.parameters(), state.model.parameters()))
    # the manifest, its quarantine marker and the step's listing once each: the read lease's marker is
    # read before the located step is checked, so the check under the lease is that same check
    assert sum(k.endswith("/MANIFEST.json") for k in reads) == 1, reads
    assert listings == [step_key(3)], listings
    assert sum(k.endswith("/.metadata") for k in reads) == 1, reads
    assert len(agreements) == 1  # the checkpoint, its manifest and its .metadata in one agreement


def _counting_reads(root: str, monkeypatch) -> tuple:
    """The store at ``root`` and the list its data reads append ``(key, offset)`` to."""
    store = open_store(root)
    ranges: list[tuple[str, int]] = []
    read_into = store.read_into
    monkeypatch.setattr(store, "read_into", lambda key, offset, buffer, **kw: ranges.append((key, offset))
                        or read_into(key, offset, buffer, **kw))
    return store, ranges


@pytest.mark.parametrize("slack, requests", [(8000, 1), (0, 2)], ids=["within the slack: one", "no slack: two"])
def test_a_file_read_whole_a_little_past_the_request_cap_is_one_request(tmp_path, monkeypatch, slack, requests):
    import relaunch.components.core.checkpoint.dcp_io as dcp_io

    root = str(tmp_path / "store")
    # 320000 tensor bytes plus archive records; each payload over DIRECT_BYTES, so chunks of its own (smaller
    # items share 64 KiB chunks, and a chunk is never split between two requests)
    source = {f"w{i}": torch.randn(20_000) for i in range(4)}
    _save(root, {"m": source})
    monkeypatch.setattr(dcp_io, "REQUEST_BYTES", 320_000)
    monkeypatch.setattr(dcp_io, "REQUEST_SLACK", slack)
    store, ranges = _counting_reads(root, monkeypatch)
    target = {"m": {k: torch.zeros_like(v) for k, v in source.items()}}
    CheckpointManager(store).load(target)
    assert all(torch.equal(target["m"][k], v) for k, v in source.items())
    assert len([key for key, _ in ranges if key.endswith(".distcp")]) == requests, ranges


@pytest.mark.parametrize("store_kind", ["fs", "s3"])
def test_a_file_holding_a_tensor_over_the_request_cap_is_read_as_one_range_with_its_leading_items(
        tmp_path, monkeypatch, store_kind, request):
    """A large tensor behind a few small ones in the same file: one ranged read of the file, not a
    small range for the leading items and another for the payload (each a request on S3)."""
    import relaunch.components.core.checkpoint.dcp_io as dcp_io

    if store_kind == "s3":
        server = request.getfixturevalue("s3_env")
        server.create_bucket("one-range")
        root = "s3://one-range/ckpt"
    else:
        root = str(tmp_path / "store")
    source = {"a_small": torch.randn(10), "b_small": torch.randn(20), "c_large": torch.randn(20000)}
    _save(root, {"m": source})
    monkeypatch.setattr(dcp_io, "REQUEST_BYTES", 16000)  # the large tensor's 80000 bytes are over the cap
    monkeypatch.setattr(dcp_io, "REQUEST_SLACK", 4000)  # more than the leading items and their records
    store, ranges = _counting_reads(root, monkeypatch)
    target = {"m": {k: torch.zeros_like(v) for k, v in source.items()}}
    CheckpointManager(store).load(target)
    assert all(torch.equal(target["m"][k], v) for k, v in source.items())
    data = [key for key, _ in ranges if key.endswith(".distcp")]
    assert len(data) == len(set(data)), ranges  # each data file one range


class _Remote:
    """A filesystem store seen through a latency, as the checkpoint code sees S3, GCS or Azure (not a
    FileStore, so it takes the object-store path): every request but the data reads sleeps 0.2 s."""

    SLOW = ("read_bytes", "write_bytes", "write_if_absent", "sizes", "list", "exists", "etag", "delete")

    def __init__(self, inner):
        self._inner, self.requests, self.data_reads = inner, [], []

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if name == "read_into":
            return lambda *a, **kw: self.data_reads.append(time.monotonic()) or attr(*a, **kw)
        if name not in self.SLOW:
            return attr

        def request(key, *args, **kw):
            started = time.monotonic()
            time.sleep(0.2)  # far above any thread's start-up, so requests made together overlap
            try:
                return attr(key, *args, **kw)
            finally:
                self.requests.append((started, time.monotonic(), f"{name} {key}"))
        return request


def test_a_load_asks_the_store_in_five_rounds_before_its_first_data_byte(tmp_path):
    """On S3, GCS or Azure each request costs milliseconds: requests that do not depend on each other
    go together. The pointers (latest.json, inflight.json); the read lease; its deletion marker; the
    manifest; then its quarantine marker, the step's listing and .metadata: 5 rounds, not 8."""
    root = str(tmp_path / "store")
    state = make_state(width=16)
    _save(root, state, step=3)
    store = _Remote(open_store(root))
    mgr = CheckpointManager(store)
    fresh = make_state(seed=5, width=16)
    assert mgr.load(fresh).step == 3
    assert all(torch.equal(a, b) for a, b in zip(fresh.model.parameters(), state.model.parameters()))
    assert store.data_reads, "the load read its data through the store"
    before = sorted(r for r in store.requests if r[1] <= min(store.data_reads))
    rounds: list[list[tuple[float, float, str]]] = []
    for request in before:  # a request that starts after every request of the current round has ended opens the next
        if rounds and request[0] < max(end for _, end, _ in rounds[-1]):
            rounds[-1].append(request)
        else:
            rounds.append([request])
    mgr.close()
    named = [[what.split(" ", 1)[0] + " " + what.rsplit("/", 1)[-1] for _, _, what in r] for r in rounds]
    assert len(rounds) == 5, named
    assert sorted(named[0]) == ["read_bytes inflight.json", "read_bytes latest.json"], named
    assert sorted(w.split(" ")[0] for w in named[-1]) == ["read_bytes", "read_bytes", "sizes"], named
