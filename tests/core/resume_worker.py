"""A training process for the exact-resume tests, run in a fresh interpreter (alone or by torchrun):

    python -m tests.core.resume_worker --root R --out D --steps N [--resume] [--save-at N]
    torchrun --nproc-per-node 2 -m tests.core.resume_worker ...

Trains the helper MLP (DDP when distributed) for ``--steps`` steps, optionally resuming from the
latest checkpoint first and saving at ``--save-at``; writes what must match bitwise to D/rank<r>.pt.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist

from relaunch.components.core.checkpoint import CheckpointManager
from tests.core.helpers import fingerprint, make_state, train_steps


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--save-at", type=int)
    args = p.parse_args()
    torch.set_num_threads(1)
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    state = make_state(seed=11 + rank)  # different streams per rank; DDP broadcasts rank 0's weights
    if distributed:
        state.model = torch.nn.parallel.DistributedDataParallel(state.model)
    mgr = CheckpointManager(args.root, keep_last=2, owner="resume-test")
    if args.resume:
        info = mgr.load(state)
        assert info is not None and state.step == info.step, (info, state.step)
        assert state.rng_restored
    for _ in range(args.steps):
        train_steps(state, 1)
        if args.save_at == state.step:
            mgr.save(state.step, state)
    mgr.close()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(fingerprint(state), out / f"rank{rank}.pt")
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
