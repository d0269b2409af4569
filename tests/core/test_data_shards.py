"""Datasets as committed shards in the store, streamed by the loader's worker processes
(components/core/data/): content-addressed and written once, each rank reading only its slice of each
global batch, a resume at any step and world size continuing at the same global sample, a damaged
shard one clear line. The streaming cases run on every store relaunch supports (the filesystem, moto's
S3 server, fake-gcs-server and Azurite)."""

from __future__ import annotations

import hashlib
import io
import json

import numpy as np
import psutil
import pytest

from relaunch.components.core.contract.errors import BadInput, CorruptDataset
from relaunch.components.core.data import commit_task_data, open_split
from relaunch.components.core.data.loader import ShardLoader, SplitData
from relaunch.components.core.data.order import GlobalOrder, rank_positions
from relaunch.components.core.data.shards import (DatasetSource, arrays_source, commit_source, copy_dataset,
                                                  manifest_key, read_manifest)
from relaunch.components.core.store import open_store
from tests.core.helpers import backend_root

ROW_BYTES = 8 + 4 * 3  # an int64 id and three float32 features


def _source(samples: int = 1000, key: str | None = None, calls: list | None = None) -> DatasetSource:
    """Samples whose ``id`` field is their global index in the train split (chunks of 300)."""

    def train():
        if calls is not None:
            calls.append("train")
        for start in range(0, samples, 300):
            ids = np.arange(start, min(samples, start + 300), dtype=np.int64)
            yield {"id": ids, "x": np.stack([ids, ids * 2, ids * 3], 1).astype(np.float32)}

    def val():
        yield {"id": np.arange(10, dtype=np.int64), "x": np.zeros((10, 3), np.float32)}

    return DatasetSource({"train": train, "val": val}, meta={"made_by": "test"}, source_key=key)


def _loader(uri: str, manifest, rank: int, world: int, *, workers: int = 2, total: int = 30, batch: int = 32):
    return ShardLoader(uri, manifest, "train", steps_per_epoch=manifest.samples("train") // batch, total_steps=total,
                       global_batch=batch, rank=rank, world_size=world, num_workers=workers, prefetch_batches=2, seed=7)


def _ids(loader, start: int, count: int) -> list[list[int]]:
    out, it = [], loader.batches(start)
    for _ in range(count):
        batch = next(it)
        assert batch["index"].tolist() == batch["id"].tolist()  # the row read is the row the order named
        out.append(batch["id"].tolist())
    loader.close()
    return out


def test_a_dataset_is_committed_as_content_addressed_shards_and_a_second_commit_writes_nothing(tmp_path):
    store = open_store(str(tmp_path / "store"))
    manifest, written = commit_source(store, _source(), shard_bytes=100 * ROW_BYTES)
    assert len(manifest.split("train")) == 10 and manifest.samples("train") == 1000
    assert written == 10 + 1 + 1  # train's shards, val's one, the manifest
    again, written_again = commit_source(store, _source(), shard_bytes=100 * ROW_BYTES)
    assert (again.version, written_again) == (manifest.version, 0)
    assert read_manifest(store, manifest.version).meta == {"made_by": "test"}
    rows = SplitData(store, manifest, "train").arrays()
    assert rows["id"].tolist() == list(range(1000))
    # a shard is packed rows of the manifest's dtype: numpy alone reads it
    first = manifest.split("train")[0]
    assert np.frombuffer(store.read_bytes(first.key), dtype=manifest.dtype)["id"].tolist() == list(range(100))
    other, _ = commit_source(store, _source(samples=999), shard_bytes=100 * ROW_BYTES)
    assert other.version != manifest.version


def test_a_committed_source_key_is_found_without_building_the_dataset_again(tmp_path):
    store = open_store(str(tmp_path / "store"))
    calls: list[str] = []
    manifest, _ = commit_source(store, _source(key="corpus-v1", calls=calls))
    assert calls == ["train"]
    again, written = commit_source(store, _source(key="corpus-v1", calls=calls))
    assert (again.version, written, calls) == (manifest.version, 0, ["train"])



def test_a_source_record_whose_manifest_is_missing_is_no_record_and_prepare_commits_the_manifest_again(tmp_path):
    """The source record is written beside the manifest, not after it: a crash may leave the record
    alone, and it is then read as no record."""
    store = open_store(str(tmp_path / "store"))
    calls: list[str] = []
    manifest, written = commit_source(store, _source(key="corpus-v1", calls=calls))
    assert written == 1 + 1 + 1 + 1  # train's shard, val's, the manifest, the source record
    (tmp_path / "store" / manifest_key(manifest.version)).unlink()  # the record survived, the manifest did not
    again, written_again = commit_source(store, _source(key="corpus-v1", calls=calls))
    assert (again.version, written_again, calls) == (manifest.version, 1, ["train", "train"])  # the manifest alone
    assert read_manifest(store, manifest.version).version == manifest.version

def test_a_source_key_known_only_once_the_source_is_read_is_found_by_content_and_a_second_commit_writes_nothing(tmp_path):
    """A key computed as the chunks are built (a callable): prepare builds without looking for a record
    (there is none to find before the key), and the second commit finds every shard and the manifest."""
    store = open_store(str(tmp_path / "store"))
    calls: list[str] = []
    base = _source(calls=calls)
    late = DatasetSource(base.splits, meta=base.meta, source_key=lambda: "corpus-v1-" + str(len(calls)))
    assert not late.key_known_early and late.source_key == "corpus-v1-0"
    manifest, written = commit_source(store, late, shard_bytes=100 * ROW_BYTES)
    assert written == 10 + 1 + 1 and calls == ["train"]  # train's shards, val's, the manifest: no record
    assert not store.list("datasets/sources")
    again, written_again = commit_source(store, late, shard_bytes=100 * ROW_BYTES)
    assert (again.version, written_again, calls) == (manifest.version, 0, ["train", "train"])


@pytest.fixture(params=["fs", "s3", "gcs", "azure"])
def root(request, tmp_path):
    return backend_root(request, tmp_path, "data")


def test_each_rank_streams_its_slice_of_every_global_batch_from_worker_processes(root):
    store = open_store(root)
    manifest, _ = commit_source(store, _source(), shard_bytes=100 * ROW_BYTES)
    ranks = [_loader(root, manifest, rank, 2) for rank in (0, 1)]
    it = ranks[0].batches(0)
    next(it)
    workers = psutil.Process().children()
    assert len(workers) >= 2  # the loader's worker processes read the shards, not the training process
    ranks[0].close()
    steps = 31  # one epoch (1000 // 32) and the first step of the next
    per_rank = [_ids(_loader(root, manifest, rank, 2, total=steps), 0, steps) for rank in (0, 1)]
    order = GlobalOrder([s.samples for s in manifest.split("train")], seed=7)
    for step in range(steps):
        epoch, within = divmod(step, 31)
        both = per_rank[0][step] + per_rank[1][step]
        assert both == order.indices(epoch, rank_positions(within, 32, 0, 1)).tolist()
    epoch0 = [i for step in range(31) for r in (0, 1) for i in per_rank[r][step]]
    assert len(epoch0) == len(set(epoch0)) == 31 * 32  # no sample twice in an epoch


def test_a_resume_at_another_world_size_continues_at_the_same_global_sample(tmp_path):
    uri = str(tmp_path / "store")
    manifest, _ = commit_source(open_store(uri), _source(), shard_bytes=100 * ROW_BYTES)
    uninterrupted = [sum(step, []) for step in zip(*[_ids(_loader(uri, manifest, r, 2), 0, 30) for r in (0, 1)])]
    # 2 ranks for 9 steps, 1 rank for the next 11, 2 ranks again to the end (mid-epoch each time)
    resumed = [sum(step, []) for step in zip(*[_ids(_loader(uri, manifest, r, 2), 0, 9) for r in (0, 1)])]
    resumed += _ids(_loader(uri, manifest, 0, 1, workers=1), 9, 11)
    resumed += [sum(step, []) for step in zip(*[_ids(_loader(uri, manifest, r, 2), 20, 10) for r in (0, 1)])]
    assert resumed == uninterrupted


def test_a_damaged_shard_is_one_line_naming_it_never_a_wrong_sample(tmp_path):
    uri = str(tmp_path / "store")
    store = open_store(uri)
    manifest, _ = commit_source(store, _source(), shard_bytes=100 * ROW_BYTES)
    shard = manifest.split("train")[3]
    path = tmp_path / "store" / shard.key
    data = bytearray(path.read_bytes())
    data[17] ^= 0x01  # one flipped bit
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptDataset) as caught:
        _ids(_loader(uri, manifest, 0, 1, total=31), 0, 31)
    message = str(caught.value)
    assert "\n" not in message and shard.key in message and "damaged" in message and "prepare again" in message
    # the advice works: with the shard gone, commit writes it again and the loader reads every sample
    store.delete(shard.key)
    assert commit_source(store, _source(), shard_bytes=100 * ROW_BYTES)[1] == 1
    read = [i for step in _ids(_loader(uri, manifest, 0, 1, total=31), 0, 31) for i in step]
    assert read == GlobalOrder([s.samples for s in manifest.split("train")], 7).indices(0, np.arange(31 * 32)).tolist()


def test_a_dataset_stored_before_shards_is_read_as_it_was(tmp_path):
    store = open_store(str(tmp_path / "store"))
    arrays = {"train": {"x": np.arange(12, dtype=np.float32).reshape(6, 2), "y": np.arange(6)},
              "val": {"x": np.ones((2, 2), np.float32), "y": np.zeros(2, np.int64)}}
    buffer = io.BytesIO()
    np.savez(buffer, **{f"{s}.{k}": a for s, d in arrays.items() for k, a in d.items()})
    payload = buffer.getvalue()
    version = "sha256-0123456789abcdef"
    store.write_bytes(f"datasets/{version}/splits.npz", payload)
    store.write_bytes(manifest_key(version), json.dumps({
        "version": version, "format": "npz", "file": "splits.npz", "sha256": hashlib.sha256(payload).hexdigest(),
        "size": len(payload), "arrays": {f"{s}.{k}": {"dtype": a.dtype.str, "shape": list(a.shape)}
                                         for s, d in arrays.items() for k, a in d.items()}}).encode())
    split = SplitData(store, read_manifest(store, version), "train")
    assert np.array_equal(split["x"], arrays["train"]["x"]) and np.array_equal(split["y"], arrays["train"]["y"])
    with pytest.raises(BadInput, match="not in the store"):
        read_manifest(store, "sha256-0000000000000000")


def test_a_trial_folder_gets_the_dataset_checked_and_only_what_it_lacks(tmp_path):
    study, trial = open_store(str(tmp_path / "study")), open_store(str(tmp_path / "trial"))
    manifest, _ = commit_source(study, _source(), shard_bytes=200 * ROW_BYTES)
    assert copy_dataset(study, trial, manifest.version) == len(manifest.split("train")) + 1 + 1
    assert copy_dataset(study, trial, manifest.version) == 0
    assert SplitData(trial, read_manifest(trial, manifest.version), "train").arrays()["id"].tolist() == list(range(1000))


def test_the_digits_task_goes_through_the_same_path(tmp_path):
    from relaunch.components.core.contract.config import RelaunchConfig
    from relaunch.components.tasks.digits import make_task

    config = RelaunchConfig()
    store = open_store(str(tmp_path / "store"))
    manifest, _ = commit_task_data(make_task(config), store)
    assert [f["name"] for f in manifest.fields] == ["x", "y"] and manifest.samples("train") > 1000
    val = open_split(config, make_task(config), store, manifest.version, "val")
    assert len(val) == len(val["y"]) and sum(len(b["y"]) for b in val.batches(100)) == len(val)


def test_a_source_that_fills_one_buffer_again_for_every_chunk_gets_each_chunk_stored_as_it_was_handed(tmp_path):
    store = open_store(str(tmp_path / "store"))
    buffer = np.empty((7, 4), np.uint16)  # one field: the writer cuts its shards from the chunk's own memory

    def train():
        for k in range(5):
            buffer[:] = k
            yield {"tokens": buffer}

    manifest, _ = commit_source(store, DatasetSource({"train": train}), shard_bytes=10 * 8)
    assert [s.samples for s in manifest.split("train")] == [10, 10, 10, 5]
    first = SplitData(store, manifest, "train").arrays()["tokens"][:, 0].tolist()
    assert first == [k for k in range(5) for _ in range(7)]
