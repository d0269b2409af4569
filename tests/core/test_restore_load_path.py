"""A training's restore (model + AdamW after a step) through the load path: the read plan is the one
DCP itself makes, and the state comes back bitwise into a freshly built model and optimizer (as a
restarted training's) and into ones that already hold other values (a restore in place)."""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, create_default_local_load_plan

from relaunch.components.core.checkpoint import CheckpointManager
from relaunch.components.core.checkpoint.dcp_io import fast_local_load_plan
from relaunch.components.core.checkpoint.safe_pickle import load_metadata
from relaunch.components.core.store import open_store
from relaunch.components.core.trainer.state import TrainingState


def _training(seed: int, stepped: bool) -> TrainingState:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if stepped:
        for _ in range(2):
            model(torch.randn(8, 16)).sum().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return TrainingState(model, optimizer)


def _extras() -> dict[str, torch.Tensor]:
    return {"empty": torch.empty(0, 3), "scalar": torch.tensor(7, dtype=torch.int64),
            "mask": torch.rand(4, 5) > 0.5, "half": torch.randn(6).to(torch.bfloat16)}


def _same(a: TrainingState, b: TrainingState) -> None:
    for mine, theirs in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert torch.equal(mine, theirs)
        assert a.optimizer.state[mine].keys() == b.optimizer.state[theirs].keys()
        for key, value in b.optimizer.state[theirs].items():
            assert torch.equal(a.optimizer.state[mine][key], value), key
    assert a.step == b.step


def test_the_read_plan_of_a_training_state_is_the_one_dcp_makes(tmp_path):
    root = str(tmp_path / "store")
    saved = _training(0, stepped=True)
    state = {"training": saved.state_dict(), "extra": _extras()}
    with CheckpointManager(root, owner="plan", async_save=False) as mgr:
        info = mgr.save(1, state) or mgr.latest()
    metadata = load_metadata(open_store(root).read_bytes(f"{info.key}/.metadata"))
    planner = DefaultLoadPlanner()
    planner.set_up_planner({"training": _training(1, stepped=True).state_dict(), "extra": _extras()}, metadata,
                           is_coordinator=True)
    ours = fast_local_load_plan(planner.state_dict, metadata).items
    dcps = create_default_local_load_plan(planner.state_dict, metadata, True).items
    assert ours == dcps
    assert [i.dest_index.index for i in ours] == [i.dest_index.index for i in dcps]
    assert [i.storage_index.index for i in ours] == [i.storage_index.index for i in dcps]
    assert len(ours) > 10


def test_a_training_resumed_into_a_fresh_model_and_optimizer_and_into_held_ones_is_bitwise_the_saved_one(tmp_path):
    root = str(tmp_path / "store")
    saved = _training(0, stepped=True)
    saved.step = 2
    with CheckpointManager(root, owner="resume", async_save=False) as mgr:
        mgr.save(2, saved)
    fresh = _training(1, stepped=False)  # a restarted training: new model, AdamW without state
    CheckpointManager(root).load(fresh)
    _same(fresh, saved)
    held = _training(2, stepped=True)  # exists, other values: loaded in place
    pointers = [p.data_ptr() for p in held.model.parameters()] + [
        v.data_ptr() for p in held.model.parameters() for v in held.optimizer.state[p].values()]
    CheckpointManager(root).load(held)
    _same(held, saved)
    assert pointers == [p.data_ptr() for p in held.model.parameters()] + [
        v.data_ptr() for p in held.model.parameters() for v in held.optimizer.state[p].values()]
