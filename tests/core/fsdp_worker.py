"""A training process for the sharded-checkpoint tests, run by torchrun (gloo, CPU):

    torchrun --standalone --nproc-per-node N -m tests.core.fsdp_worker --root R --out D \\
        --parallelism fsdp|ddp [--steps K] [--save-at 2,4] [--resume] [--crash-after K] [--ranks-per-node M]

Builds the same MLP on every rank (seed 11), shards it with FSDP2 or wraps it in DDP, seeds each
rank's data streams by its rank, optionally loads the latest checkpoint, trains, saves. Rank 0 writes
the full (unsharded) model and optimizer state to D/loaded.pt after the load and D/step<k>.pt at each
save and D/final.pt at the end; every rank writes D/rank<r>.json (loaded step, store.stats).
"""

from __future__ import annotations

import time

PROCESS_STARTED = time.time()  # before torch is imported: "kill -> state loaded" splits here

import argparse
import importlib
import json
import os
import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from relaunch.components.core.checkpoint import CheckpointManager
from relaunch.components.core.trainer.parallel import wrap_model
from relaunch.components.core.trainer.state import TrainingState


def full_state(state: TrainingState) -> dict:
    """The unsharded model and optimizer state (a collective), on CPU."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_sd, optim_sd = get_state_dict(state.model, state.optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"model": model_sd, "optim": optim_sd, "step": state.step}


def _rss() -> tuple[int, int]:
    """(current, peak) resident set size in bytes, from /proc/self/status."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return (int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024)


def _local_bytes(state: TrainingState) -> int:
    total = 0
    for value in [*state.model.state_dict().values(), *(v for s in state.optimizer.state.values() for v in s.values())]:
        if isinstance(value, torch.Tensor):
            local = getattr(value, "_local_tensor", value)
            total += local.numel() * local.element_size()
    return total


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
    p.add_argument("--no-dump", action="store_true", help="write no full-state files (benchmarks)")
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
    timing: dict = {}
    if args.resume:
        # What every process pays once whatever it loads (imports) is part of "kill -> state loaded",
        # not of the load: the load's time and peak RSS are measured from here on.
        for module_name in ("torch.distributed.checkpoint.state_dict", "relaunch.components.core.checkpoint.dcp_io"):
            importlib.import_module(module_name)
        mgr.store.stats.clear()
        Path("/proc/self/clear_refs").write_text("5")  # peak RSS from here on (the load's own)
        rss_before = _rss()[0]
        started = time.perf_counter()
        info = mgr.load(state)
        timing = {"load_seconds": time.perf_counter() - started, "loaded_at": time.time(),
                  "process_started": PROCESS_STARTED,
                  "rss_before_load": rss_before, "rss_peak_during_load": _rss()[1], "share_bytes": _local_bytes(state)}
        loaded = info.step if info else None
        stats = dict(mgr.store.stats)
        if not args.no_dump:
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
            if not args.no_dump:
                snapshot = full_state(state)
                if rank == 0:
                    torch.save(snapshot, out / f"step{state.step}.pt")
        if args.crash_after == state.step:
            os._exit(137)  # killed mid-run: no close, no clean-up
    if not args.no_dump:
        snapshot = full_state(state)
        if rank == 0:
            torch.save(snapshot, out / "final.pt")
    (out / f"rank{rank}.json").write_text(json.dumps({"loaded_step": loaded, "stats": stats, **timing}))
    mgr.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
