"""Exact resume: 2N steps straight == N steps, save, load in a fresh process, N more steps — bitwise
(parameters, optimizer, scheduler, data cursor, python/numpy/torch RNG streams), with 1 process and
with 2 ranks under a real torchrun (gloo); and a 2-rank checkpoint loads the same values into 1 rank.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from relaunch.components.core.checkpoint import CheckpointManager
from relaunch.components.core.contract.errors import BadInput
from tests import warm_processes
from tests.core.helpers import assert_bitwise_equal, make_state, s3_root, train_steps

ROOT = Path(__file__).resolve().parents[2]
N = 4


def _run(args: list[str], nproc: int, env: dict | None = None) -> None:
    if nproc == 1:
        cmd = [sys.executable, "-m", "tests.core.resume_worker", *args]
    else:
        cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node", str(nproc),
               "-m", "tests.core.resume_worker", *args]
    proc = warm_processes.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
                                                   **(env or {})}, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


def _load(out: Path, rank: int):
    return torch.load(out / f"rank{rank}.pt", weights_only=True)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["fs", "s3", "gcs", "azure"])
def test_training_2n_steps_straight_equals_n_steps_then_a_resume_in_a_fresh_process(backend, tmp_path, request):
    root = {"fs": lambda: str(tmp_path / "store"), "s3": lambda: s3_root(request.getfixturevalue("s3_env"), "resume"),
            "gcs": lambda: request.getfixturevalue("gcs_env").root("resume"),
            "azure": lambda: request.getfixturevalue("azure_env").root("resume")}[backend]()
    _run(["--root", str(tmp_path / "straight-store"), "--out", str(tmp_path / "straight"), "--steps", str(2 * N)], 1)
    _run(["--root", root, "--out", str(tmp_path / "first"), "--steps", str(N), "--save-at", str(N)], 1)
    _run(["--root", root, "--out", str(tmp_path / "resumed"), "--steps", str(N), "--resume"], 1)
    assert_bitwise_equal(_load(tmp_path / "straight", 0), _load(tmp_path / "resumed", 0))


@pytest.mark.slow
def test_two_ranks_resume_exactly_and_a_two_rank_checkpoint_loads_into_one_rank(tmp_path):
    root = str(tmp_path / "store")
    _run(["--root", str(tmp_path / "straight-store"), "--out", str(tmp_path / "straight"), "--steps", str(2 * N)], 2)
    _run(["--root", root, "--out", str(tmp_path / "first"), "--steps", str(N), "--save-at", str(N)], 2)
    _run(["--root", root, "--out", str(tmp_path / "resumed"), "--steps", str(N), "--resume"], 2)
    for rank in (0, 1):
        assert_bitwise_equal(_load(tmp_path / "straight", rank), _load(tmp_path / "resumed", rank))

    # 2 -> 1 resharding: the same parameter and optimizer values, rank 0's RNG streams
    state = make_state(seed=123)
    info = CheckpointManager(root).load(state)
    assert info.world_size == 2 and state.step == N and state.rng_restored
    first = _load(tmp_path / "first", 0)
    resumed_after_load = {"params": [p.detach() for p in state.model.parameters()],
                          "optim": state.optimizer.state_dict()}
    first_at_n = {"params": first["params"], "optim": first["optim"]}
    assert_bitwise_equal(first_at_n, resumed_after_load)


def test_a_checkpoint_of_another_model_is_refused_as_bad_input(tmp_path):
    mgr = CheckpointManager(str(tmp_path))
    state = make_state(width=8)
    train_steps(state, 1)
    mgr.save(1, state)
    mgr.wait()
    with pytest.raises(BadInput, match="checkpoint of another model"):
        CheckpointManager(str(tmp_path)).load(make_state(width=16))


def test_custom_state_objects_and_the_data_cursor_round_trip(tmp_path):
    class Cursor:
        def __init__(self):
            self.position, self.order = 0, [3, 1, 2]

        def state_dict(self):
            return {"position": self.position, "order": list(self.order)}

        def load_state_dict(self, sd):
            self.position, self.order = sd["position"], sd["order"]

    state = make_state()
    cursor = Cursor()
    state.extra["cursor"] = cursor
    cursor.position, cursor.order = 77, [9, 8]
    state.epoch, state.sampler_epoch, state.samples_seen = 3, 3, 1234
    mgr = CheckpointManager(str(tmp_path))
    mgr.save(5, state)
    mgr.wait()
    fresh = make_state()
    fresh.extra["cursor"] = other = Cursor()
    info = CheckpointManager(str(tmp_path)).load(fresh)
    assert (info.epoch, fresh.epoch, fresh.sampler_epoch, fresh.samples_seen) == (3, 3, 3, 1234)
    assert (other.position, other.order) == (77, [9, 8])


def test_the_snapshot_is_taken_before_save_returns(tmp_path):
    """Training may change the model the moment save() returns: the checkpoint holds the old values."""
    mgr = CheckpointManager(str(tmp_path), async_save=True)
    state = make_state()
    before = [p.detach().clone() for p in state.model.parameters()]
    mgr.save(1, state)
    with torch.no_grad():
        for p in state.model.parameters():
            p.add_(1.0)
    mgr.wait()
    fresh = make_state(seed=9)
    CheckpointManager(str(tmp_path)).load(fresh)
    assert all(torch.equal(a, b) for a, b in zip(fresh.model.parameters(), before))
    assert mgr.stall_seconds_total > 0 and mgr.last_save_seconds > 0
