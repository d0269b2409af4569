"""A stand-in worker for the in-place agent's tests: ``python -m tests.launchers.inplace_worker MODE``.

``kill``: rank 1 of generation 0 SIGKILLs itself; the others wait for the agent's next generation
(what a survivor does) and exit 0, printing their pid and generation. ``bad``: rank 1 exits 2 (a bad
input); the others wait to be stopped. ``preempt``: every rank waits for SIGTERM and exits 143."""

from __future__ import annotations

import datetime
import os
import signal
import sys
import time

import torch.distributed as dist

from relaunch.components.core.runtime.generations import GENERATION_ENV, GENERATION_KEY


def main() -> int:
    mode, rank, gen = sys.argv[1], int(os.environ["RANK"]), int(os.environ[GENERATION_ENV])
    print(f"worker rank={rank} pid={os.getpid()} generation={gen}", flush=True)
    if mode == "preempt":
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        time.sleep(60)
        return 1
    if rank == 1 and gen == 0:
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        return 2
    if mode == "bad" or rank == 1:
        time.sleep(0 if rank == 1 else 60)
        return 0
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
    while int(store.get(GENERATION_KEY)) == gen:
        time.sleep(0.05)
    print(f"worker rank={rank} pid={os.getpid()} rejoined generation={int(store.get(GENERATION_KEY))}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
