"""``launch.inject_failure``: the faults a demo or a test asks the training to suffer, on purpose.

    kill-worker@step=N       the last rank SIGKILLs itself before step N (torchrun restarts the group; with
                             the memory tier, once its snapshot in flight reached its holder, see below)
    preempt@step=N           rank 0 sends SIGTERM to every rank before step N (checkpoint, exit 143)
    storage-outage@step=N    every store call stalls for OUTAGE_SECONDS, as a transient error + backoff would

With the memory tier, the kill waits for the rank's memory snapshot still being handed over (the step
just done, taken beside the training): a rank lost during a hand-over is rightly recovered from the store,
and a demo or test of the recovery from memory must not land there by the machine's scheduling.

Each fires once per training: the rank that fires claims a marker in the store first, so a resumed
attempt passing step N again does not fire it again. (Not to be confused with ``tests/core/faults.py``,
the checkpoint tests' crash and network faults.)
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Callable

from ..contract.config import parse_failure_spec
from ..store.records import injected_key

OUTAGE_SECONDS = 3.0  # long enough for several backoff rounds, short enough for a demo
_FIRST_RETRY_SECONDS, _MAX_RETRY_SECONDS = 0.05, 1.0


class Injection:
    """``launch.inject_failure`` on one rank; :meth:`before_step` fires it at its step."""

    def __init__(self, spec: str | None, store, rank: int, world: int, pids: list[int]):
        self.kind, self.step = parse_failure_spec(spec)  # validated by the config model
        self.store, self.rank, self.world, self.pids = store, rank, world, pids
        self.outage_until = 0.0
        self.settle: Callable[[], object] | None = None  # waits for a memory snapshot in flight (the tier sets it)

    @classmethod
    def for_world(cls, spec: str | None, store, env) -> "Injection":
        """The injection of this rank (collective: every rank learns every rank's pid, which a
        preemption signals)."""
        pids = [os.getpid()]
        if env.world_size > 1:
            import torch.distributed as dist

            pids = [None] * env.world_size
            dist.all_gather_object(pids, os.getpid())
        return cls(spec, store, env.rank, env.world_size, pids)

    def _claim(self) -> bool:
        return self.store.write_if_absent(injected_key(self.kind, self.step), b"fired")

    def before_step(self, step: int) -> None:
        if step != self.step:
            return
        if self.kind == "kill-worker" and self.rank == self.world - 1 and self._claim():
            if self.settle is not None:
                self.settle()
            print(f"relaunch: inject {self.kind}@step={step}: SIGKILL to rank {self.rank}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.kind == "preempt" and self.rank == 0 and self._claim():
            print(f"relaunch: inject preempt@step={step}: SIGTERM to the worker group", file=sys.stderr, flush=True)
            for pid in self.pids:
                os.kill(pid, signal.SIGTERM)
        elif self.kind == "storage-outage" and self.rank == 0 and self._claim():
            self.outage_until = time.monotonic() + OUTAGE_SECONDS
            print(f"relaunch: inject storage-outage: the store fails for {OUTAGE_SECONDS:g} s", file=sys.stderr,
                  flush=True)


class OutageStore:
    """Wraps the store; while an injected outage lasts every call waits with backoff, then goes through."""

    def __init__(self, store, injection: Injection):
        self._store, self._injection = store, injection
        self.failed_calls = 0

    def __getattr__(self, name):
        target = getattr(self._store, name)
        if not callable(target):
            return target

        def call(*args, **kwargs):
            delay = _FIRST_RETRY_SECONDS
            while time.monotonic() < self._injection.outage_until:
                self.failed_calls += 1  # what a real transient error + backoff does, without the error
                time.sleep(delay)
                delay = min(delay * 2, _MAX_RETRY_SECONDS)
            return target(*args, **kwargs)

        return call


def wrap_store(store, injection: Injection):
    """The store the training uses: ``store`` itself, or wrapped when a storage outage is injected."""
    return OutageStore(store, injection) if injection.kind == "storage-outage" else store
