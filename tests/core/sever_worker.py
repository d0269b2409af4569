"""A rank of a 3-process gloo group for tests/core/test_sever.py, run by torchrun:

    torchrun --standalone --nproc-per-node 3 -m tests.core.sever_worker --out D

Every rank joins the group through :func:`relaunch.components.core.runtime.distributed.init` with a
60 s collective timeout, and holds a reference to the group (as a survivor's model does). Rank 0 then
leaves the group without taking part in the next collective: it severs the group's connections
(``--sever``) or only destroys the group; ranks 1 and 2 enter an all-gather that needs rank 0 and write
D/rank<r>.json: how long they waited and whether the collective raised.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from relaunch.components.core.runtime import distributed as distr

TIMEOUT_SECONDS = 60.0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sever", action="store_true")
    args = parser.parse_args()
    env = distr.read_env()
    distr.init(env, TIMEOUT_SECONDS)
    held = dist.group.WORLD  # what a survivor's model keeps: the group outlives destroy_process_group
    data = torch.zeros(1 << 18)
    if env.rank == 0:
        time.sleep(1.0)  # the others are inside the all-gather by now
        closed = distr.sever() if args.sever else 0
        distr.shutdown()
        (args.out / "rank0.json").write_text(json.dumps({"closed": closed}))
        deadline = time.monotonic() + TIMEOUT_SECONDS + 5  # alive, as a survivor is, while the others wait or fail
        while time.monotonic() < deadline and not all((args.out / f"rank{r}.json").exists()
                                                      for r in range(1, env.world_size)):
            time.sleep(0.05)
        return
    began, raised = time.monotonic(), False
    try:
        dist.all_gather([torch.empty_like(data) for _ in range(env.world_size)], data)
    except RuntimeError:
        raised = True
    (args.out / f"rank{env.rank}.json").write_text(json.dumps({"raised": raised, "waited": time.monotonic() - began}))
    del held
    os._exit(0)


if __name__ == "__main__":
    main()
