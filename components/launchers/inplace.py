"""The in-place agent: one node's workers, kept alive across the loss of a peer (``train.memory_tier``).

    python -m relaunch.components.launchers.inplace --nproc-per-node=2 --max-restarts=3 \\
        -m relaunch.components.train --config-json '{...}'
    # one agent per node of a multi-node job; node 0's hosts the store the others reach
    python -m relaunch.components.launchers.inplace --nnodes=2 --node-rank=1 --master-addr=HOST0 \\
        --master-port=23456 --node-address=THIS_HOST --nproc-per-node=2 -m relaunch.components.train ...

torchrun's agent restarts the whole worker group on any worker failure, so survivors cannot keep their
processes (and the memory they hold) under it. This agent starts the workers itself; node 0's hosts
their rendezvous store (a ``TCPStore``), the other nodes' agents are its clients. Generations are
rendezvous rounds: every worker's process group is scoped to the generation it joins
(``TORCHELASTIC_RESTART_COUNT``, the key prefix of :func:`relaunch.components.core.runtime.distributed.init`).
The store's ``relaunch/generation`` is the current one; an agent starts the next with a compare-and-set,
so agents of several nodes that lose workers at once start one generation between them, and every agent
follows a generation another started (a whole-group one: it restarts its workers too).

- A worker killed (a signal, or 137) while others live: the agent waits ``SETTLE_SECONDS`` for the
  ones killed with it, bumps the generation in its store and starts a replacement for each of the
  same rank. The survivors, whose collectives broke, see the new generation and rejoin it in place
  (:mod:`relaunch.components.core.recovery.in_place`); the replacement gets its state from its peer's replica.
- A worker lost before it entered its generation's rendezvous (its mark, ``joined_key``, not set: a
  replacement killed while it starts): its replacement goes into that same generation, whose
  rendezvous still waits for the rank (a new one would leave the survivors waiting in that rendezvous
  until its timeout). One lost after it entered may have left its address there: a new generation.
- Every worker killed: the whole group starts again (a new generation; the store serves it).
- Any other failure (a hang's 138, a bad input's 2, a divergence's 3, a preemption's 143): the
  existing path, the whole group stopped (after up to ``END_GRACE_SECONDS`` in which the others end by
  themselves with the cause the worker recorded); restarted when the code is retryable and restarts are
  left, else the agent ends with that code.

Across nodes: a killed worker is replaced by its own node's agent (the survivors on every node keep
their processes); a node lost whole (its pod gone: the agent and its workers) is replaced when its agent
starts again (the kubelet or the job's restart; the store counts each node's agents): that agent starts
the next generation with all of its ranks, whose state comes from the replicas their peers on other
nodes hold (:func:`relaunch.components.core.recovery.memory_tier.holder_of`). An ending that is not a
restart (a permanent code, no restarts left, a signal the workers ended on) is published in the store and
every agent ends with it.
Node 0 hosts the store: its loss ends every agent with 138 (retry me: the job's restart starts the whole
group again, from the store).

Each restart (a replacement or a whole group) counts against ``--max-restarts`` of the agent that
started it. Its lines on stderr (``relaunch inplace: ...``) name every worker's pid and what happened to
it. It exits with the contract's code (the workers' own: no blanket 1 to map).
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

from ..core.contract.entry import exit_on_error
from ..core.contract.errors import BadInput
from ..core.contract.exitcodes import ExitCode, is_retryable
from ..core.runtime.net import free_port
from ..core.runtime.wiring import wire
from ..core.store.procfs import stat_fields
from ..core.runtime.zygote import CLIENT_PATH, CLIENT_SOURCE, client_command
from ..core.runtime.zygote_client import ZYGOTE_ENV
from ..core.runtime.generations import (
                                        DONE_KEY, END_KEY, GENERATION_ENV, GENERATION_KEY, NODE_ADDRESS_ENV, NODE_STARTS_KEY, REPLACE, RESTART,
                                        generation_key, joined_key,
                                        )

MODULE = "relaunch.components.launchers.inplace"  # ``python -m MODULE``: this agent
SETTLE_SECONDS = 0.005  # after a death: then the others already dying with it (killed together) are waited for
PF_EXITING = 0x4  # include/linux/sched.h: the task is in do_exit (a SIGKILL delivered)
SIGKILL_BIT = 1 << (signal.SIGKILL - 1)  # in /proc/<pid>/status's pending-signal masks
STOP_SECONDS = 15.0
END_GRACE_SECONDS = 5.0  # a worker ended with a code of its own: how long its peers get to end by themselves
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
    """Runs ``nproc`` workers of ``command`` (argv after the interpreter) to their end: node
    ``node_rank`` of ``nnodes``, whose ranks are ``node_rank * nproc ...``; node 0's agent hosts the
    store at ``master_addr:master_port`` (a free port on one node when none is given)."""

    def __init__(self, command: list[str], nproc: int, *, max_restarts: int = 3, run_id: str | None = None,
                 env: dict[str, str] | None = None, timeout_seconds: float = 300.0,
                 zygote_client: str | os.PathLike | None = None,
                 nnodes: int = 1, node_rank: int = 0, master_addr: str = "127.0.0.1", master_port: int | None = None,
                 node_address: str = "127.0.0.1"):
        import torch.distributed as dist  # heavy: only the agent itself needs it, not its importers

        if nproc < 1:
            raise BadInput(f"--nproc-per-node={nproc}: must be at least 1")
        if not 0 <= node_rank < nnodes:
            raise BadInput(f"--node-rank={node_rank}: must be from 0 to --nnodes-1 ({nnodes - 1})")
        if nnodes > 1 and not master_port:
            raise BadInput("--nnodes > 1 needs --master-port (node 0's store, the same on every node)")
        self.command, self.nproc, self.max_restarts = command, nproc, max_restarts
        self.nnodes, self.node_rank, self.master_addr, self.node_address = nnodes, node_rank, master_addr, node_address
        # with the zygote's client: every worker, a replacement too, is a fork of the zygote its environment
        # names (torch imported)
        self.interpreter = client_command(sys.executable, zygote_client) if zygote_client else [sys.executable]
        self.run_id = run_id or uuid.uuid4().hex[:8]
        self.base_env = dict(os.environ if env is None else env)
        self.port = master_port or free_port()
        self.store = dist.TCPStore(master_addr, self.port, is_master=node_rank == 0, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=timeout_seconds))
        self.store_error = dist.DistError  # the store's errors (node 0 gone), by type
        self.restarts = 0
        self.workers: list[subprocess.Popen | None] = [None] * nproc
        self.told_to_stop = False  # a signal was forwarded: the workers end, nothing is restarted
        if node_rank == 0:
            self.store.set(GENERATION_KEY, "0")
            self.store.set(generation_key(0), RESTART)
        self.generation = int(self.store.get(GENERATION_KEY))  # a client's get waits for node 0's set
        # a node's second agent (its pod lost whole and started again) replaces all of its ranks
        self.rejoining = self.store.add(f"{NODE_STARTS_KEY}/{node_rank}", 1) > 1

    @property
    def multi_node(self) -> bool:
        return self.nnodes > 1

    def _start(self, local: int) -> subprocess.Popen:
        env = {**self.base_env, "RANK": str(self._rank(local)), "WORLD_SIZE": str(self.nnodes * self.nproc),
               "LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": str(self.nproc), "GROUP_RANK": str(self.node_rank),
               "MASTER_ADDR": self.master_addr,
               "MASTER_PORT": str(self.port), "TORCHELASTIC_USE_AGENT_STORE": "True",
               "TORCHELASTIC_RESTART_COUNT": str(self.generation), "TORCHELASTIC_RUN_ID": self.run_id,
               GENERATION_ENV: str(self.generation), NODE_ADDRESS_ENV: self.node_address, "PYTHONUNBUFFERED": "1"}
        env.setdefault("OMP_NUM_THREADS", "1")
        proc = subprocess.Popen([*self.interpreter, *self.command], env=env)
        self.workers[local] = proc
        return proc

    def _rank(self, local: int) -> int:
        return self.node_rank * self.nproc + local

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

    def _let_end(self) -> None:
        """A worker ended with a code of its own (not killed), here or on another node: until this node's
        other workers have ended by themselves, or for ``END_GRACE_SECONDS``. The worker left its cause in
        this store (:mod:`relaunch.components.core.runtime.causes`) and its peers, whose collectives it broke,
        end with that cause at once, each recording it and saying it: a SIGTERM would stop them in the
        middle of that (and the job would end with this agent's line instead of the cause)."""
        end = time.monotonic() + END_GRACE_SECONDS
        while time.monotonic() < end and any(p is not None and p.poll() is None for p in self.workers):
            self._wait_for_an_end(end - time.monotonic())

    def _pids(self) -> str:
        return " ".join(f"rank{self._rank(r)}={p.pid}" for r, p in enumerate(self.workers) if p is not None)

    def _stop_all(self) -> None:
        for sig, wait in ((signal.SIGTERM, STOP_SECONDS), (signal.SIGKILL, 5.0)):
            for p in self.workers:
                if p is not None and p.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        p.send_signal(sig)
            end = time.monotonic() + wait
            while time.monotonic() < end and any(p is not None and p.poll() is None for p in self.workers):
                time.sleep(POLL_SECONDS)

    def _mode(self, gen: int) -> str:
        self.store.wait([generation_key(gen)])  # set right after the generation by the agent that started it
        return self.store.get(generation_key(gen)).decode()

    def _new_generation(self, mode: str, *, lost: list[int] | None = None) -> None:
        """Start the next generation (``mode``: REPLACE, only the lost ranks start; RESTART, every rank).
        With ``lost`` (the ranks of this node's killed workers), take the current generation instead
        when it still waits for them (:meth:`_waits_for`): the workers of several nodes lost at once, or
        a worker lost before it entered the generation's rendezvous, go into that one."""
        self.restarts += 1
        current = int(self.store.get(GENERATION_KEY))
        while True:
            if lost and self._waits_for(current, lost):
                self.generation = current
                return
            seen = self.store.compare_set(GENERATION_KEY, str(current), str(current + 1)).decode()
            if seen == str(current + 1):
                self.store.set(generation_key(current + 1), mode)
                self.generation = current + 1
                return
            current = int(seen)

    def _waits_for(self, gen: int, ranks: list[int]) -> bool:
        """Whether generation ``gen`` (this agent's, or a replacing one another node's agent started
        since) can take replacements of ``ranks``: none of them entered its rendezvous, which then
        still waits for each. One that did may have left its address there, which only a new
        generation replaces."""
        if gen > self.generation and self._mode(gen) != REPLACE:
            return False
        return not any(self.store.check([joined_key(gen, rank)]) for rank in ranks)

    def _losing(self) -> bool:
        """Whether a worker of this node has ended badly or is dying (a SIGKILL pending)."""
        return any(p is not None and (p.poll() not in (None, 0) or _dying(p.pid)) for p in self.workers)

    def _followed(self) -> bool:
        """Take a generation another node's agent started: for a whole-group one, this node's workers
        start again too. Whether one was taken. A replacing one is not taken while a worker of this node
        is lost: it may have died before that generation began, so the failure path joins it with the
        worker's replacement (taken first, the worker's loss would start yet another generation while
        the survivors waited in this one for the missing rank)."""
        current = int(self.store.get(GENERATION_KEY))
        if current <= self.generation:
            return False
        modes = [self._mode(g) for g in range(self.generation + 1, current + 1)]
        if RESTART not in modes and self._losing():
            return False
        self.generation = current
        if RESTART in modes:
            say(f"generation {current}: another node restarts the whole group; so does this one")
            self._stop_all()
            self._start_all()
        return True

    def _end_everywhere(self, code: int) -> int:
        """This node ends the job with ``code``: every other node's agent reads it and ends so too."""
        if self.multi_node:
            with contextlib.suppress(self.store_error):  # node 0 gone: its loss ends the others anyway
                self.store.set(END_KEY, str(code))
        return code

    def _ended_elsewhere(self) -> int | None:
        if self.multi_node and self.store.check([END_KEY]):
            return int(self.store.get(END_KEY))
        return None

    def _done(self) -> int:
        """Every worker of this node ended 0. Node 0's agent hosts the store: it waits (up to
        ``STOP_SECONDS``) for the other nodes' workers to end before its store goes."""
        if not self.multi_node:
            return int(ExitCode.OK)
        done = self.store.add(DONE_KEY, 1)
        end = time.monotonic() + STOP_SECONDS
        while self.node_rank == 0 and done < self.nnodes and time.monotonic() < end:
            time.sleep(POLL_SECONDS)
            done = self.store.add(DONE_KEY, 0)
        return int(ExitCode.OK)

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
        try:
            return self._run()
        except self.store_error as err:  # node 0's store is gone: nothing here can rejoin; the job's restart can
            say(f"the store on node 0 ({self.master_addr}:{self.port}) is gone ({type(err).__name__}): "
                f"stopping this node's workers")
            self._stop_all()
            return int(ExitCode.RETRY_ME)

    def _run(self) -> int:
        elsewhere = self._ended_elsewhere()
        if elsewhere is not None:
            say(f"another node ended the job with {elsewhere} before this node started: starting nothing")
            return elsewhere
        if self.rejoining:
            self._new_generation(REPLACE)
            self._start_all()
            say(f"node {self.node_rank} started again: its ranks join generation {self.generation} "
                f"as replacements: {self._pids()}")
        else:
            self._start_all()
            say(f"generation {self.generation} workers: {self._pids()}")
        while True:
            codes = [p.poll() for p in self.workers]
            if all(c == 0 for c in codes):
                return self._done()
            if self.told_to_stop:
                if any(c is None for c in codes):
                    time.sleep(POLL_SECONDS)
                    continue
                code = next((int(c) if c > 0 else 128 - c for c in codes if c != 0), int(ExitCode.OK))
                return self._end_everywhere(code) if code else code
            elsewhere = self._ended_elsewhere()
            if elsewhere is not None:
                say(f"another node ended the job with {elsewhere}: stopping this node's workers")
                self._let_end()
                self._stop_all()
                return elsewhere
            failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if not failed:
                if not (self.multi_node and self._followed()):
                    self._wait_for_an_end(POLL_SECONDS)
                continue
            self._settle()
            codes = [p.poll() for p in self.workers]
            failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
            worst = next((codes[r] for r in failed if not _killed(codes[r])), None)
            if worst is not None:  # not a lost worker: the existing path, the whole group
                say(f"rank {self._rank(failed[0])} ended with {worst}: stopping the group")
                self._let_end()
                self._stop_all()
                code = int(worst)
                if not is_retryable(code) or self.restarts >= self.max_restarts:
                    return self._end_everywhere(code)
                self._restart_all()
                continue
            if self.restarts >= self.max_restarts:
                self._stop_all()
                say(f"ranks {[self._rank(r) for r in failed]} killed and no restarts left "
                    f"(--max-restarts={self.max_restarts})")
                return self._end_everywhere(int(ExitCode.KILLED))
            survivors = [r for r, c in enumerate(codes) if c is None]
            finished = all(codes[r] == 0 for r in range(self.nproc) if r not in failed)
            if not self.multi_node and (not survivors or finished):
                self._stop_all()
                self._restart_all()
                continue
            if self.multi_node and self._followed():  # another node restarts the whole group: the lost start with it
                continue
            before = self.generation
            self._new_generation(REPLACE, lost=[self._rank(r) for r in failed])
            for local in failed:
                old = self.workers[local].pid
                self._start(local)
                say(f"rank {self._rank(local)} (pid {old}) killed ({codes[local]}): replacement pid "
                    f"{self.workers[local].pid} joins generation {self.generation}"
                    + (" (whose rendezvous still waits for the rank: it had not entered it)"
                       if self.generation == before else "") + "; survivors keep their processes"
                    + (": " + " ".join(f"rank{self._rank(r)}={self.workers[r].pid}" for r in survivors)
                       if survivors else " (on other nodes)"))

    def _start_all(self) -> None:
        for local in range(self.nproc):
            self._start(local)

    def _restart_all(self) -> None:
        """A whole-group generation: every rank of this node starts again (the other nodes' follow)."""
        self._new_generation(RESTART)
        self._start_all()
        say(f"generation {self.generation}: the whole group started again: {self._pids()}")

    def close(self) -> None:
        self._stop_all()


POD_ADDRESS = "RELAUNCH_POD_IP"
"""A multi-node pod's own address (the downward API's ``status.podIP``): its agent's ``--node-address``."""


def agent_args(spec: Any, run_id: str, *, warm: bool = False, node_rank: int | str = 0, master_addr: str = "",
               master_port: int | str = "", node_address: str = "") -> list[str]:
    """The agent's arguments for one node of ``spec`` (a :class:`~relaunch.components.launchers.jobs.JobSpec`):
    what follows ``python -m relaunch.components.launchers.inplace``; ``warm``: workers from the zygote.
    With several nodes, where node ``node_rank`` finds node 0's store and where its peers reach it
    (strings may be ``$(VAR)`` references a pod expands)."""
    nodes = [f"--nnodes={spec.nodes}", f"--node-rank={node_rank}", f"--master-addr={master_addr}",
             f"--master-port={master_port}", f"--node-address={node_address}"] if spec.nodes > 1 else []
    return [f"--nproc-per-node={spec.procs_per_node}", f"--max-restarts={spec.restart.max_restarts}",
            f"--run-id={run_id}", *nodes, *(["--warm"] if warm else []),
            "-m", spec.module, "--config-json", spec.config_json]


def memory_tier(spec: Any) -> bool:
    """Whether the job of ``spec`` recovers from memory (``train.memory_tier`` of its configuration: a
    cluster's job only when set, :func:`~relaunch.components.core.contract.config.memory_tier_on`)."""
    return bool(json.loads(spec.config_json).get("train", {}).get("memory_tier", False))


def pod_command(spec: Any, run_id: str, *, master_addr: str = "$(PET_MASTER_ADDR)",
                master_port: int | str = "$(PET_MASTER_PORT)", node_rank: str = "$(PET_NODE_RANK)") -> list[str]:
    """A pod's container command for a job with the memory tier: the in-place agent under the supervisor
    (:mod:`relaunch.components.launchers.supervise`), which forwards signals and maps codes and, seeing the
    zygote's client in the command, starts the pod's zygote: every worker, a replacement too, is a fork of a
    process that imported torch and the task (the client starts a worker cold without it). With several
    nodes, node 0's store at ``master_addr:master_port`` and this pod's node rank and address
    (:func:`pod_env`) as the pod expands them."""
    return ["python", "-m", "relaunch.components.launchers.supervise", "python", "-m",
            MODULE, "--zygote-client", CLIENT_PATH,
            *agent_args(spec, run_id, node_rank=node_rank, master_addr=master_addr, master_port=master_port,
                        node_address=f"$({POD_ADDRESS})")]


def pod_env(spec: Any) -> list[dict[str, Any]]:
    """The env :func:`pod_command` needs beside the job's: a multi-node pod's own address."""
    if spec.nodes > 1 and memory_tier(spec):
        return [{"name": POD_ADDRESS, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
    return []


def main(argv: list[str] | None = None) -> int:
    """``python -m relaunch.components.launchers.inplace --nproc-per-node N [--max-restarts K] -m MODULE ARGS...``"""
    wire()
    parser = argparse.ArgumentParser(prog="python -m relaunch.components.launchers.inplace",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc-per-node", type=int, required=True)
    parser.add_argument("--max-restarts", type=int, default=3)
    parser.add_argument("--nnodes", type=int, default=1)
    parser.add_argument("--node-rank", type=int, default=0)
    parser.add_argument("--master-addr", default="127.0.0.1", help="node 0's store (node 0: where it listens)")
    parser.add_argument("--master-port", type=int, default=None, help="node 0's store's port (one node: a free one)")
    parser.add_argument("--node-address", default="127.0.0.1",
                        help="this node's address that other nodes reach (the memory tier's replica servers)")
    parser.add_argument("--run-id", default=None)
    parser.add_argument("--zygote-client", default=None, metavar="PATH",
                        help="start workers (and replacements) through the zygote client at PATH: forks of the zygote "
                             "the environment names (a pod's supervisor starts one for this), else fresh interpreters")
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
                             zygote_client=args.zygote_client or (CLIENT_SOURCE if args.warm else None),
                             nnodes=args.nnodes, node_rank=args.node_rank, master_addr=args.master_addr,
                             master_port=args.master_port, node_address=args.node_address)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            signal.signal(sig, agent.forward)
        try:
            return agent.run()
        finally:
            agent.close()

    return run()


if __name__ == "__main__":
    sys.exit(main())
