"""Format versions: a version-1 checkpoint written by relaunch before format 2 (a fixture made with
that code) still loads, on a filesystem and from S3, and a new save on top of it writes the current version."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from relaunch.components.core.checkpoint import FORMAT_VERSION, CheckpointManager, step_key
from relaunch.components.core.trainer.state import TrainingState
from relaunch.components.core.store import open_store
from tests.core.helpers import s3_root

FIXTURE = Path(__file__).parent / "fixtures" / "v1-store"


def _fixture_model() -> TrainingState:
    torch.manual_seed(123)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    return TrainingState(model, torch.optim.AdamW(model.parameters(), lr=0.01))


@pytest.fixture(params=["fs", "s3"])
def v1_root(request, tmp_path):
    if request.param == "fs":
        shutil.copytree(FIXTURE, tmp_path / "store")
        return str(tmp_path / "store")
    root = s3_root(request.getfixturevalue("s3_env"), "v1")
    store = open_store(root)
    for path in FIXTURE.rglob("*"):
        if path.is_file():
            store.write_bytes(path.relative_to(FIXTURE).as_posix(), path.read_bytes())
    return root


def test_a_version_1_checkpoint_loads_and_the_next_save_is_the_current_version(v1_root):
    manifest = json.loads(open_store(v1_root).read_bytes(f"{step_key(3)}/MANIFEST.json"))
    assert manifest["format_version"] == 1
    expected = torch.load(FIXTURE.parent / "v1-store-params.pt", weights_only=True)
    state = _fixture_model()
    with CheckpointManager(v1_root, owner="v1-test", async_save=False) as mgr:
        assert mgr.latest().step == 3
        mgr.verify(3)  # sha256 of every file
        assert mgr.load(state).step == 3
        assert state.step == 3 and state.optimizer.state_dict()["state"]
        for name, value in state.model.state_dict().items():
            assert torch.equal(value, expected[name]), name
        mgr.save(4, state)
    manifest = json.loads(open_store(v1_root).read_bytes(f"{step_key(4)}/MANIFEST.json"))
    assert manifest["format_version"] == FORMAT_VERSION == 3 and manifest["digest"] == "xxh3_128"


V2_FIXTURE = Path(__file__).parent / "fixtures" / "v2-store"


def test_a_version_2_checkpoint_with_16_mib_chunks_still_loads_and_deep_verifies(tmp_path):
    # written by the code of the first format-2 release (chunk_bytes 16 MiB; today's writer cuts 1 MiB)
    shutil.copytree(V2_FIXTURE, tmp_path / "store")
    expected = torch.load(V2_FIXTURE.parent / "v2-store-state.pt", weights_only=True)
    state = _fixture_model()
    with CheckpointManager(str(tmp_path / "store"), owner="v2-test", async_save=False) as mgr:
        mgr.verify(2)
        assert mgr.load(state).step == 2
    assert all(torch.equal(v, expected["model"][k]) for k, v in state.model.state_dict().items())
    loaded = state.optimizer.state_dict()["state"]
    assert loaded.keys() == expected["optimizer"]["state"].keys()
    for p, entries in expected["optimizer"]["state"].items():
        assert all(torch.equal(loaded[p][k], v) for k, v in entries.items()), p


def test_items_of_many_chunks_load_whatever_chunk_size_wrote_them_and_a_flip_in_one_is_caught(tmp_path, monkeypatch):
    from relaunch.components.core.checkpoint import verify
    from relaunch.components.core.contract.errors import CorruptCheckpoint

    monkeypatch.setattr(verify, "CHUNK_BYTES", 1000)  # items of many chunks, tensors cut mid-element
    root = str(tmp_path / "store")
    saved = {"w": torch.randn(64, 33), "b": torch.randn(7)}
    with CheckpointManager(root, owner="chunks", async_save=False) as mgr:
        mgr.save(1, {k: v.clone() for k, v in saved.items()})
    monkeypatch.setattr(verify, "CHUNK_BYTES", 1 << 20)
    chunks = json.loads(open_store(root).read_bytes(f"{step_key(1)}/MANIFEST.json"))["files"]["__0_0.distcp"]["chunks"]
    assert len(chunks) > 8
    target = {k: torch.zeros_like(v) for k, v in saved.items()}
    CheckpointManager(root).load(target)
    assert all(torch.equal(target[k], v) for k, v in saved.items())
    path = open_store(root).path(f"{step_key(1)}/__0_0.distcp")
    data = bytearray(path.read_bytes())
    data[chunks[5][0] + 3] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpoint, match=f"bytes {chunks[5][0]}..{chunks[5][0] + chunks[5][1]} "):
        CheckpointManager(root).load({k: torch.zeros_like(v) for k, v in saved.items()}, step=1)
