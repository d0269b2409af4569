"""A training process for the sharded-checkpoint tests, run by torchrun (gloo, CPU):

    torchrun --standalone --nproc-per-node N -m tests.core.fsdp_worker --root R --out D \\
        --parallelism fsdp|ddp [--steps K] [--save-at 2,4] [--resume] [--crash-after K] [--ranks-per-node M]

Builds the same MLP on every rank (seed 11), shards it with FSDP2 or wraps it in DDP, seeds each
rank's data streams by its rank, optionally loads the latest checkpoint, trains, saves. Rank 0 writes
the full (unsharded) model and optimizer state to D/loaded.pt after the load and D/step<k>.pt at each
save and D/final.pt at the end; every rank writes D/rank<r>.json (loaded step, store.stats).
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from components.core.checkpoint import CheckpointManager
from components.core.parallel import wrap_model
from components.core.state import TrainingState


def full_state(state: TrainingState) -> dict:
    """The unsharded model and optimizer state (a collective), on CPU."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_sd, optim_sd = get_state_dict(state.model, state.optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"model": model_sd, "optim": optim_sd, "step": state.step}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--parallelism", choices=["ddp", "fsdp"], default="fsdp")
    p.add_argument("--steps", type=int, default=0)
    p.add_argument("--save-at", default="")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--crash-after", type=int)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--ranks-per-node", type=int)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(11)
    module = torch.nn.Sequential(torch.nn.Linear(16, args.width), torch.nn.Tanh(), torch.nn.Linear(args.width, 4))
    model = wrap_model(module, parallelism=args.parallelism, device=torch.device("cpu"))
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.01)
    state = TrainingState(module, optimizer)
    random.seed(100 + rank)
    np.random.seed(100 + rank)
    torch.manual_seed(100 + rank)
    mgr = CheckpointManager(args.root, keep_last=0, owner="fsdp-test", async_save=False,
                            ranks_per_node=args.ranks_per_node)
    loaded = None
    if args.resume:
        mgr.store.stats.clear()
        info = mgr.load(state)
        loaded = info.step if info else None
        stats = dict(mgr.store.stats)
        snapshot = full_state(state)
        if rank == 0:
            torch.save(snapshot, out / "loaded.pt")
    else:
        stats = {}
    saves = {int(s) for s in args.save_at.split(",") if s}
    for _ in range(args.steps):
        x = torch.randn(8, 16) + float(np.random.rand()) + random.random()
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        state.step += 1
        if state.step in saves:
            mgr.save(state.step, state)
            snapshot = full_state(state)
            if rank == 0:
                torch.save(snapshot, out / f"step{state.step}.pt")
        if args.crash_after == state.step:
            os._exit(137)  # killed mid-run: no close, no clean-up
    snapshot = full_state(state)
    if rank == 0:
        torch.save(snapshot, out / "final.pt")
    (out / f"rank{rank}.json").write_text(json.dumps({"loaded_step": loaded, "stats": stats}))
    mgr.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
