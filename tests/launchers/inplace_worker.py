"""A stand-in worker for the in-place agent's tests: ``python -m tests.launchers.inplace_worker MODE [RANK]``.

``kill``: rank RANK (default 1) of generation 0 SIGKILLs itself; the others wait for the agent's next
generation (what a survivor does) and exit 0, printing their pid and generation. ``bad``: rank RANK exits 2
(a bad input); the others wait to be stopped. ``preempt``: every rank waits for SIGTERM and exits 143.
``wait``: every rank of generation 0 waits for the next generation, then exits 0 (a node lost whole and
started again: its ranks start in it). ``lost-before-joining`` / ``lost-after-joining``: rank RANK of
generation 0 SIGKILLs itself, and so does its first replacement, before / after it says it enters its
generation's rendezvous; the second replacement ends the test; the others wait for that. A worker whose
store is gone exits 138, as a survivor does. Every worker says it enters its generation's rendezvous
first (what ``distributed.init`` does for the agent's workers), but for the first replacement lost
before joining."""

from __future__ import annotations

import datetime
import os
import signal
import sys
import time

import torch.distributed as dist

from relaunch.components.core.runtime.generations import GENERATION_ENV, GENERATION_KEY, joined_key


VICTIM_DONE = "test/victim-done"


def main() -> int:
    mode, rank, gen = sys.argv[1], int(os.environ["RANK"]), int(os.environ[GENERATION_ENV])
    victim = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    try:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
        lost = mode.startswith("lost-") and rank == victim  # marks itself when its mode says (lost_victim)
        if not lost:
            # marked before it says it runs (a test may kill it then): a real worker is marked before its
            # peers can train with it
            store.set(joined_key(gen, rank), "1")
        print(f"worker rank={rank} pid={os.getpid()} generation={gen}", flush=True)
        if lost:
            return lost_victim(mode, store, rank, gen)
    except dist.DistError:
        print(f"worker rank={rank} pid={os.getpid()}: the store is gone", flush=True)
        return 138
    if mode == "preempt":
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        time.sleep(60)
        return 1
    if mode == "wait":
        if gen > 0:  # a replacement (of a node lost whole): nothing to wait for
            return 0
    elif mode.startswith("lost-"):  # a survivor: until the victim's rank is done
        store.wait([VICTIM_DONE])
        print(f"worker rank={rank} pid={os.getpid()} rejoined generation={int(store.get(GENERATION_KEY))}",
              flush=True)
        return 0
    elif rank == victim:
        if gen > 0:  # its replacement
            return 0
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        return 2
    elif mode == "bad":
        time.sleep(60)  # until the agent stops it
        return 0
    try:
        while int(store.get(GENERATION_KEY)) == gen:
            time.sleep(0.05)
        now = int(store.get(GENERATION_KEY))
    except dist.DistError:
        print(f"worker rank={rank} pid={os.getpid()}: the store is gone", flush=True)
        return 138
    print(f"worker rank={rank} pid={os.getpid()} rejoined generation={now}", flush=True)
    return 0


def lost_victim(mode: str, store, rank: int, gen: int) -> int:
    """The victim's rank: lost in generation 0 (joined), its first replacement lost too (joined or
    not, by ``mode``), its second one done."""
    if gen == 0:
        store.set(joined_key(gen, rank), "1")
        os.kill(os.getpid(), signal.SIGKILL)
    if store.add("test/replacements", 1) == 1:
        if mode == "lost-after-joining":
            store.set(joined_key(gen, rank), "1")
        os.kill(os.getpid(), signal.SIGKILL)
    store.set(joined_key(gen, rank), "1")
    store.set(VICTIM_DONE, "1")
    return 0


if __name__ == "__main__":
    sys.exit(main())
