"""The in-place agent: one node's workers, kept alive across the loss of a peer (``train.memory_tier``).

    python -m relaunch.components.launchers.inplace --nproc-per-node=2 --max-restarts=3 \\
        -m relaunch.components.train --config-json '{...}'

torchrun's agent restarts the whole worker group on any worker failure, so survivors cannot keep their
processes (and the memory they hold) under it. This agent starts the workers itself and hosts their
rendezvous store (a ``TCPStore``). Generations are rendezvous rounds: every worker's process group is
scoped to the generation it joins (``TORCHELASTIC_RESTART_COUNT``, the key prefix of
:func:`relaunch.components.core.runtime.distributed.init`).

- A worker killed (a signal, or 137) while others live: the agent waits ``SETTLE_SECONDS`` for the
  ones killed with it, bumps the generation in its store and starts a replacement for each of the
  same rank. The survivors, whose collectives broke, see the new generation and rejoin it in place
  (:mod:`relaunch.components.core.trainer.inplace`); the replacement gets its state from its peer's replica.
- Every worker killed: the whole group starts again (a new generation; the store serves it).
- Any other failure (a hang's 138, a bad input's 2, a divergence's 3, a preemption's 143): the
  existing path, the whole group stopped; restarted when the code is retryable and restarts are left,
  else the agent ends with that code.

Each restart (a replacement or a whole group) counts against ``--max-restarts``. Its lines on stderr
(``relaunch inplace: ...``) name every worker's pid and what happened to it. It exits with the
contract's code (the workers' own: no blanket 1 to map).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import select
import signal
import subprocess
import sys
import time
import uuid
from typing import Any

from relaunch.components.core.contract.entry import exit_on_error
from relaunch.components.core.contract.errors import BadInput
from relaunch.components.core.contract.exitcodes import ExitCode, is_retryable
from relaunch.components.core.runtime.net import free_port
from relaunch.components.core.store.procfs import stat_fields
from relaunch.components.core.runtime.zygote import client_command
from relaunch.components.core.runtime.zygote_client import ZYGOTE_ENV
from relaunch.components.core.runtime.generations import GENERATION_ENV, GENERATION_KEY, generation_key

SETTLE_SECONDS = 0.005  # after a death: then the others already dying with it (killed together) are waited for
PF_EXITING = 0x4  # include/linux/sched.h: the task is in do_exit (a SIGKILL delivered)
SIGKILL_BIT = 1 << (signal.SIGKILL - 1)  # in /proc/<pid>/status's pending-signal masks
STOP_SECONDS = 15.0
POLL_SECONDS = 0.05


def say(line: str) -> None:
    print(f"relaunch inplace: {line}", file=sys.stderr, flush=True)


def _killed(code: int) -> bool:
    return code < 0 or code == ExitCode.KILLED


def _dying(pid: int) -> bool:
    """Whether ``pid`` has a SIGKILL pending or is exiting (Linux ``/proc``; elsewhere, False)."""
    fields = stat_fields(pid)
    if fields is None:
        return False
    if int(fields[6]) & PF_EXITING:  # field 9, the flags
        return True
    try:
        with open(f"/proc/{pid}/status") as f:
            masks = [line.split()[1] for line in f if line.startswith(("SigPnd:", "ShdPnd:"))]
        return any(int(mask, 16) & SIGKILL_BIT for mask in masks)
    except (OSError, ValueError, IndexError):
        return False


class InPlaceAgent:
    """Runs ``nproc`` workers of ``command`` (argv after the interpreter) to their end."""

    def __init__(self, command: list[str], nproc: int, *, max_restarts: int = 3, run_id: str | None = None,
                 env: dict[str, str] | None = None, timeout_seconds: float = 300.0, warm: bool = False):
        import torch.distributed as dist  # heavy: only the agent itself needs it, not its importers

        if nproc < 1:
            raise BadInput(f"--nproc-per-node={nproc}: must be at least 1")
        self.command, self.nproc, self.max_restarts = command, nproc, max_restarts
        # warm: every worker, a replacement too, is a fork of the zygote its environment names (torch imported)
        self.interpreter = client_command() if warm else [sys.executable]
        self.run_id = run_id or uuid.uuid4().hex[:8]
        self.base_env = dict(os.environ if env is None else env)
        self.port = free_port()
        self.store = dist.TCPStore("127.0.0.1", self.port, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=timeout_seconds))
        self.generation = 0
        self.restarts = 0
        self.workers: list[subprocess.Popen | None] = [None] * nproc
        self.told_to_stop = False  # a signal was forwarded: the workers end, nothing is restarted
        self.store.set(GENERATION_KEY, "0")

    def _start(self, rank: int) -> subprocess.Popen:
        env = {**self.base_env, "RANK": str(rank), "WORLD_SIZE": str(self.nproc), "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": str(self.nproc), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(self.port), "TORCHELASTIC_USE_AGENT_STORE": "True",
               "TORCHELASTIC_RESTART_COUNT": str(self.generation), "TORCHELASTIC_RUN_ID": self.run_id,
               GENERATION_ENV: str(self.generation), "PYTHONUNBUFFERED": "1"}
        env.setdefault("OMP_NUM_THREADS", "1")
        proc = subprocess.Popen([*self.interpreter, *self.command], env=env)
        self.workers[rank] = proc
        return proc

    def _wait_for_an_end(self, seconds: float) -> None:
        """Until a worker ends or ``seconds`` pass: the kernel wakes the agent at a death (a pidfd per
        live worker), so detection does not wait for the next poll."""
        poller, fds = select.poll(), []
        try:
            for p in self.workers:
                if p is not None and p.returncode is None:
                    try:
                        fds.append(os.pidfd_open(p.pid))
                    except ProcessLookupError:  # already reaped: the caller's poll sees its code
                        continue
                    except OSError:  # a kernel before 5.3 has no pidfd_open: wait as a poll would
                        time.sleep(seconds)
                        return
                    poller.register(fds[-1], select.POLLIN)
            poller.poll(seconds * 1000)
        finally:
            for fd in fds:
                os.close(fd)

    def _settle(self) -> None:
        """After a death, until the workers killed with it (one node lost: several ranks) have ended
        too, so that one generation replaces them all: those with a SIGKILL pending or already exiting
        (``/proc``), waited for up to ``STOP_SECONDS``; without ``/proc``, ``SETTLE_SECONDS`` more."""
        time.sleep(SETTLE_SECONDS)
        end = time.monotonic() + STOP_SECONDS
        while time.monotonic() < end:
            dying = [p for p in self.workers if p is not None and p.poll() is None and _dying(p.pid)]
            if not dying:
                return
            self._wait_for_an_end(POLL_SECONDS)

    def _pids(self) -> str:
        return " ".join(f"rank{r}={p.pid}" for r, p in enumerate(self.workers) if p is not None)

    def _stop_all(self) -> None:
        for sig, wait in ((signal.SIGTERM, STOP_SECONDS), (signal.SIGKILL, 5.0)):
            for p in self.workers:
                if p is not None and p.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        p.send_signal(sig)
            end = time.monotonic() + wait
            while time.monotonic() < end and any(p is not None and p.poll() is None for p in self.workers):
                time.sleep(POLL_SECONDS)

    def _new_generation(self) -> None:
        self.generation += 1
        self.restarts += 1
        self.store.set(GENERATION_KEY, str(self.generation))
        self.store.set(generation_key(self.generation), "")

    def forward(self, signum: int, _frame=None) -> None:
        """SIGTERM/SIGINT/SIGUSR1 of the agent go to every worker (the preemption path); the agent then
        waits for them and ends with their code, restarting nothing."""
        self.told_to_stop = True
        for p in self.workers:
            if p is not None and p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signum)

    def run(self) -> int:
        """Start the workers, replace the killed ones in place, end with the contract's code."""
        for rank in range(self.nproc):
            self._start(rank)
        say(f"generation 0 workers: {self._pids()}")
        while True:
            codes = [p.poll() for p in self.workers]
            if all(c == 0 for c in codes):
                return int(ExitCode.OK)
            if self.told_to_stop:
                if any(c is None for c in codes):
                    time.sleep(POLL_SECONDS)
                    continue
                return next((int(c) if c > 0 else 128 - c for c in codes if c != 0), int(ExitCode.OK))
            failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if not failed:
                self._wait_for_an_end(POLL_SECONDS)
                continue
            self._settle()
            codes = [p.poll() for p in self.workers]
            failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
            worst = next((codes[r] for r in failed if not _killed(codes[r])), None)
            if worst is not None:  # not a lost worker: the existing path, the whole group
                say(f"rank {failed[0]} ended with {worst}: stopping the group")
                self._stop_all()
                code = int(worst)
                if not is_retryable(code) or self.restarts >= self.max_restarts:
                    return code
                self._restart_all()
                continue
            if self.restarts >= self.max_restarts:
                self._stop_all()
                say(f"ranks {failed} killed and no restarts left (--max-restarts={self.max_restarts})")
                return int(ExitCode.KILLED)
            survivors = [r for r, c in enumerate(codes) if c is None]
            if not survivors or all(codes[r] == 0 for r in range(self.nproc) if r not in failed):
                self._stop_all()
                self._restart_all()
                continue
            self._new_generation()
            for rank in failed:
                old = self.workers[rank].pid
                self._start(rank)
                say(f"rank {rank} (pid {old}) killed ({codes[rank]}): replacement pid {self.workers[rank].pid} "
                    f"joins generation {self.generation}; survivors keep their processes: "
                    + " ".join(f"rank{r}={self.workers[r].pid}" for r in survivors))

    def _restart_all(self) -> None:
        self._new_generation()
        for rank in range(self.nproc):
            self._start(rank)
        say(f"generation {self.generation}: the whole group started again: {self._pids()}")

    def close(self) -> None:
        self._stop_all()


def agent_args(spec: Any, run_id: str, *, warm: bool = False) -> list[str]:
    """The agent's arguments for the one node of ``spec`` (a :class:`~relaunch.components.launchers.jobs.JobSpec`):
    what follows ``python -m relaunch.components.launchers.inplace``; ``warm``: workers from the zygote."""
    return [f"--nproc-per-node={spec.procs_per_node}", f"--max-restarts={spec.restart.max_restarts}",
            f"--run-id={run_id}", *(["--warm"] if warm else []), "-m", spec.module, "--config-json", spec.config_json]


def runs_in_place(config: Any) -> bool:
    """Whether a local launch of ``config`` runs this agent: the memory tier on one node (across simulated
    nodes, torchrun's whole-group restarts)."""
    return bool(config.train.memory_tier) and config.launch.nodes == 1


def memory_tier(spec: Any) -> bool:
    """Whether the job of ``spec`` recovers from memory (``train.memory_tier`` of its configuration)."""
    return bool(json.loads(spec.config_json).get("train", {}).get("memory_tier", False))


def pod_command(spec: Any, run_id: str) -> list[str]:
    """A pod's container command for a one-node job with the memory tier: the in-place agent under the
    supervisor (:mod:`relaunch.components.launchers.supervise`), which forwards signals and maps codes."""
    return ["python", "-m", "relaunch.components.launchers.supervise", "python", "-m",
            "relaunch.components.launchers.inplace", *agent_args(spec, run_id)]


def main(argv: list[str] | None = None) -> int:
    """``python -m relaunch.components.launchers.inplace --nproc-per-node N [--max-restarts K] -m MODULE ARGS...``"""
    parser = argparse.ArgumentParser(prog="python -m relaunch.components.launchers.inplace",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc-per-node", type=int, required=True)
    parser.add_argument("--max-restarts", type=int, default=3)
    parser.add_argument("--run-id", default=None)
    parser.add_argument("--warm", action="store_true",
                        help="start workers (and replacements) as forks of the zygote named by the environment")
    argv = list(sys.argv[1:] if argv is None else argv)
    at = argv.index("-m") if "-m" in argv else len(argv)
    args = parser.parse_args(argv[:at])
    args.command = argv[at:]

    @exit_on_error("relaunch inplace")
    def run() -> int:
        if not args.command:
            raise BadInput("relaunch inplace: give the worker's command, e.g. -m relaunch.components.train --config-json JSON")
        if args.warm and not os.environ.get(ZYGOTE_ENV):
            raise BadInput(f"relaunch inplace: --warm needs a zygote (${ZYGOTE_ENV} is not set); drop --warm")
        agent = InPlaceAgent(args.command, args.nproc_per_node, max_restarts=args.max_restarts, run_id=args.run_id,
                             warm=args.warm)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            signal.signal(sig, agent.forward)
        try:
            return agent.run()
        finally:
            agent.close()

    return run()


if __name__ == "__main__":
    sys.exit(main())
