"""Content-addressed datasets in the store (components/core/store/datasets.py)."""

from __future__ import annotations

import numpy as np
import pytest

from relaunch.components.core.store.datasets import dataset_version, read_dataset, write_dataset
from relaunch.components.core.contract.errors import BadInput, CorruptCheckpoint
from relaunch.components.core.store import open_store
from relaunch.components.tasks.digits import digits_splits


def test_dataset_versions_are_content_addressed_written_once_and_read_back_equal(tmp_path):
    store = open_store(str(tmp_path))
    splits = digits_splits(0.15, 0.15, 0)
    version = write_dataset(store, splits)
    assert version == dataset_version(splits) == write_dataset(store, splits)
    assert version != dataset_version(digits_splits(0.15, 0.15, 1))
    back = read_dataset(store, version)
    assert all(np.array_equal(back[s][k], splits[s][k]) for s in splits for k in splits[s])


def test_a_tampered_dataset_file_is_refused_and_an_unknown_version_is_bad_input(tmp_path):
    store = open_store(str(tmp_path))
    version = write_dataset(store, {"train": {"x": np.arange(6, dtype=np.float32), "y": np.arange(6)}})
    with pytest.raises(BadInput, match="not in the store"):
        read_dataset(store, "sha256-0000000000000000")
    store.write_bytes(f"datasets/{version}/splits.npz", b"not an npz")
    with pytest.raises(CorruptCheckpoint, match="sha256"):
        read_dataset(store, version)
