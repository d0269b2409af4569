"""Format versions: a version-1 checkpoint written by relaunch before format 2 (a fixture made with
that code) still loads, on a filesystem and from S3, and a new save on top of it writes version 2."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from components.core.checkpoint import FORMAT_VERSION, CheckpointManager, step_key
from components.core.state import TrainingState
from components.core.storage import open_store
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


def test_a_version_1_checkpoint_loads_and_the_next_save_is_version_2(v1_root):
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
    assert manifest["format_version"] == FORMAT_VERSION == 2 and manifest["digest"] == "xxh3_128"
