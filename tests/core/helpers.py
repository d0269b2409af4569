"""A tiny deterministic training setup shared by the checkpoint tests."""

from __future__ import annotations

import random
import uuid

import numpy as np
import torch

from relaunch.components.core.checkpoint import CheckpointManager
from relaunch.components.core.trainer.state import TrainingState


def make_state(seed: int = 0, width: int = 8) -> TrainingState:
    """A small MLP with AdamW, a StepLR scheduler and a GradScaler (disabled on CPU), seeded."""
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Tanh(), torch.nn.Linear(width, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    return TrainingState(model, opt, sched, scaler)


def train_steps(state: TrainingState, n: int) -> None:
    """n optimizer steps whose data come from the python, numpy and torch RNG streams."""
    for _ in range(n):
        x = torch.randn(8, 4) + float(np.random.rand()) + random.random()
        loss = state.model(x).pow(2).mean()
        state.optimizer.zero_grad()
        loss.backward()
        state.optimizer.step()
        state.scheduler.step()
        state.step += 1
        state.samples_seen += 8


def fingerprint(state: TrainingState) -> dict[str, object]:
    """Everything that must be bitwise equal after an exact resume."""
    return {
        "params": [p.detach().clone() for p in state.model.parameters()],
        "optim": state.optimizer.state_dict(),
        "sched": state.scheduler.state_dict(),
        "progress": (state.step, state.samples_seen),
        "rng": (random.random(), float(np.random.rand()), torch.rand(3)),
    }


def assert_bitwise_equal(a: object, b: object, path: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), path
        for k in a:
            assert_bitwise_equal(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bitwise_equal(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def s3_root(server, name: str = "ckpt") -> str:
    """A fresh prefix in a test bucket (created on first use)."""
    server.create_bucket("relaunch-ckpt")
    return f"s3://relaunch-ckpt/{name}-{uuid.uuid4().hex[:8]}"


def backend_root(request, tmp_path, name: str) -> str:
    """A fresh store root for a fixture parametrized by backend (``request.param``: fs, s3, gcs or azure),
    on that backend's server (the session's fixtures start it)."""
    if request.param == "fs":
        return str(tmp_path / "store")
    if request.param in ("gcs", "azure"):
        return request.getfixturevalue(f"{request.param}_env").root(name)
    return s3_root(request.getfixturevalue("s3_env"), name)


def save_three_steps(uri: str, owner: str) -> dict[str, object]:
    """Train and save steps 1-3 into ``uri`` (keep_last=2); the fingerprint of the state step 3 saved."""
    state = make_state(seed=3)
    writer = CheckpointManager(uri, keep_last=2, async_save=False, owner=owner)
    for step in (1, 2, 3):
        train_steps(state, 1)
        writer.save(step, state)
    writer.close()
    return fingerprint(state)
