"""Launch backend ``local``: ``nodes`` torchrun agents on this machine, ``procs_per_node`` workers
each, meeting at a c10d rendezvous on 127.0.0.1 — the same elastic machinery as on a cluster, with
processes standing in for nodes. What it runs, per simulated node ``i`` (agent 0 hosts the store):

    python -m torch.distributed.run --nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d \\
        --rdzv-endpoint=127.0.0.1:PORT --rdzv-id=JOB --rdzv-conf=is_host=true \\
        --max-restarts=3 --monitor-interval=0.5 -m relaunch.components.train --config-json '{...}'

Warm (a launch step forked from ``relaunch run``'s warm server; ``--cold`` or ``RELAUNCH_COLD=1`` turns it
off, and a launch step started any other way is cold), each node first gets a
zygote (:mod:`relaunch.components.core.runtime.zygote`; in ``relaunch run`` the full warm server is that zygote,
having imported torch, MLflow and the task already): torchrun's worker command becomes its stdlib client,
``--no-python python -I -S zygote_client.py -m relaunch.components.train ...``, so that every worker, first or
restarted, is a fork of a single-threaded pre-imported process: the mechanism a pod uses
(:func:`relaunch.components.launchers.jobs.supervised`). torchrun's agents themselves are plain processes.

With ``train.memory_tier`` each node's agent is :mod:`relaunch.components.launchers.inplace` instead of
torchrun (node 0's hosts the store on the rendezvous port): a killed worker is replaced while its peers,
on every node, keep their processes and their memory. Warm, the in-place agents are forks of the zygote
too (through its client): a fresh one spends seconds of CPU importing torch.distributed for its store, on
the launch's critical path (docs/warm-runtime.md has the figures).

It streams the agents' output, reads rank 0's events (:mod:`relaunch.components.core.contract.events`) from it, passes
them on to the run's event file (or draws a progress bar), and maps the outcome to the exit-code
contract: torchrun exits 1 for any worker failure, so the code of the worker that ended the attempt
is read back from the store (``runs/exit.json``, written by the trainer), else from rank 0's own
``exit`` event (it failed before it could write the record, e.g. a bad input found at set-up), else
from torchrun's failure report.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from ..core.contract import events
from ..core.contract.config import RelaunchConfig, memory_tier_on
from ..core.contract.errors import Preempted
from ..core.contract.events import Kind
from ..core.contract.exitcodes import ExitCode, is_retryable
from ..core.runtime import warm as runtime_warm
from ..core.runtime.net import free_port
from ..core.runtime.zygote import Zygote, client_command
from ..core.runtime.zygote_client import ZYGOTE_ENV
from . import LaunchResult, inplace
from .inplace import agent_args
from .jobs import TRAIN_MODULE, JobSpec, job_spec
from .torchrun import exit_code

_TORCHRUN_EXITCODE = re.compile(r"exitcode\s*:\s*(-?\d+)")
AGENT_GRACE_SECONDS = 30.0  # once one agent ended badly, how long the others get to notice
AGENT_STOP_SECONDS = 15.0  # a hung or timed-out group: from SIGTERM to SIGKILL
PERMANENT_EXIT_GRACE_SECONDS = 0.0  # rank 0 said so after its records: a torchrun restart (~1 s away) cannot help
STOP_MARGIN_SECONDS = 5.0  # beyond the preemption grace: how long preempted agents get to end


COLD_ENV = "RELAUNCH_COLD"
"""Set (to anything but empty) to start every agent and worker as a fresh interpreter, as ``--cold`` does."""


def build_commands(spec: JobSpec, *, job_id: str, port: int, warm: bool = False,
                   in_place: bool = False) -> list[list[str]]:
    """The torchrun command of each simulated node of ``spec`` (side-effect free); ``warm``: its workers
    through the zygote client. ``in_place`` (``train.memory_tier``): each node's in-place agent instead
    (:mod:`relaunch.components.launchers.inplace`), which keeps the survivors of a killed worker."""
    if in_place:
        return [[*(client_command() if warm else [sys.executable]), "-m", inplace.MODULE,
                 *agent_args(spec, job_id, warm=warm, node_rank=node, master_addr="127.0.0.1", master_port=port,
                             node_address="127.0.0.1")]
                for node in range(spec.nodes)]
    return [[sys.executable, "-m", "torch.distributed.run",
             *spec.torchrun_args(rdzv_endpoint=f"127.0.0.1:{port}", rdzv_id=job_id,
                                 rdzv_conf=f"is_host={'true' if node == 0 else 'false'}", extra=["--local-addr=127.0.0.1"],
                                 worker=client_command() if warm else ())]
            for node in range(spec.nodes)]


def launch(config: RelaunchConfig, *, pipeline_run_id: str, resume_from: str | None) -> LaunchResult:
    """Run the training to its end on this machine and report how it ended."""
    config = config.model_copy(deep=True)
    if resume_from:
        config.train.resume_from = resume_from
    config.train.memory_tier = in_place = memory_tier_on(config)  # the workers get the setting resolved
    job_id = re.sub(r"[^a-zA-Z0-9-]", "-", f"{config.name}-{pipeline_run_id or 'manual'}")[:60]
    spec = job_spec(config)
    # warm: a step forked from a warm server, or one given a zygote (a study's, for its trials' workers)
    warm = (runtime_warm.forked or bool(os.environ.get(ZYGOTE_ENV))) and not os.environ.get(COLD_ENV)
    commands = build_commands(spec, job_id=job_id, port=config.launch.rdzv_port or free_port(), warm=warm,
                              in_place=in_place)
    started = time.time()
    watch = AgentWatch(ProgressReporter.for_environment())
    with _zygotes(spec.nodes if warm else 0, config.train.task.split(":")[0]) as zygote_envs:
        agents = [start_agent(cmd, node, zygote_envs[node] if warm else {}) for node, cmd in enumerate(commands)]
        for node, agent in enumerate(agents):
            threading.Thread(target=watch.follow, args=(agent, node), daemon=True, name=f"agent-{node}-reader").start()
        try:
            codes, timed_out = wait_agents(agents, config.launch.timeout_seconds,
                                     config.train.preempt_grace_seconds + STOP_MARGIN_SECONDS, watch.ended_for_good)
        finally:  # stopped too: the agents' last lines (the preempted attempt's summary) still go out
            watch.close()
    duration = time.time() - started
    if timed_out:
        return LaunchResult(ExitCode.RETRY_ME, f"training did not finish within launch.timeout_seconds="
                            f"{config.launch.timeout_seconds:g}; stopped it", watch.restarts, watch.resumed, duration, job_id)
    code = _outcome(config, codes, watch, started)
    message = "" if code == 0 else watch.failure_message(code)
    return LaunchResult(code, message, watch.restarts, watch.resumed, duration, job_id)


@contextlib.contextmanager
def _zygotes(nodes: int, task_module: str):
    """Each node's zygote environment: the warm run's own zygote (``relaunch run``'s full server, which
    already imported torch, MLflow and the task) when it gave one, else a zygote per node started here."""
    if not nodes or os.environ.get(ZYGOTE_ENV):
        yield [{}] * nodes
        return
    with tempfile.TemporaryDirectory(prefix="relaunch-zygote-") as directory:
        zygotes = [Zygote(os.path.join(directory, f"node{node}.sock"), (TRAIN_MODULE, task_module))
                   for node in range(nodes)]
        try:
            yield [zygote.env for zygote in zygotes]
        finally:
            for zygote in zygotes:
                zygote.close()


def start_agent(cmd: list[str], node: int, zygote_env: dict[str, str]) -> subprocess.Popen:
    """Start one agent command (a torchrun or a Ray driver) in its own session, its output piped."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "RELAUNCH_NODE": str(node), **zygote_env}
    env.setdefault("OMP_NUM_THREADS", "1")
    # A fresh worker store per rendezvous round: with torchrun's shared store, a restart can pair ranks
    # whose TORCHELASTIC_RESTART_COUNT differ (an agent that only saw the others re-join keeps its count)
    # or read keys the dead round left, and the new round waits out the process-group timeout.
    env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=env,
                            start_new_session=True)


def wait_agents(agents: list[subprocess.Popen], timeout: float, stop_grace: float = AGENT_STOP_SECONDS,
          ended_for_good: Callable[[], bool] = lambda: False) -> tuple[list[int], bool]:
    """Wait for every agent; once one fails, the others get a grace period, then are stopped; once
    ``ended_for_good`` (rank 0 said it ended with a permanent code, which torchrun would restart
    anyway), they are stopped after a short grace. When this step is stopped itself, its agents get
    SIGTERM, then SIGKILL after ``stop_grace`` (the preemption grace and a margin: their preemption
    checkpoint commits)."""
    deadline = time.monotonic() + timeout
    failed_at: float | None = None
    given_up_at: float | None = None
    previous = signal.signal(signal.SIGTERM, _raise_preempted) if threading.current_thread() is threading.main_thread() else None
    try:
        while any(a.poll() is None for a in agents):
            now = time.monotonic()
            if failed_at is None and any(a.poll() not in (None, 0) for a in agents):
                failed_at = now
            if given_up_at is None and ended_for_good():
                given_up_at = now
            if now > deadline or (failed_at is not None and now - failed_at > AGENT_GRACE_SECONDS) \
                    or (given_up_at is not None and now - given_up_at > PERMANENT_EXIT_GRACE_SECONDS):
                _stop(agents, AGENT_STOP_SECONDS)
                return [a.wait() for a in agents], now > deadline
            time.sleep(0.2)
    except BaseException:  # SIGTERM/Ctrl-C of the launch step: take the agents down with us
        _stop(agents, stop_grace)
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return [a.returncode for a in agents], False


def _raise_preempted(signum, frame) -> None:
    raise Preempted("the launch step was sent SIGTERM; stopped the training (its last checkpoint stands)")


def _stop(agents: list[subprocess.Popen], grace: float) -> None:
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        for a in agents:
            if a.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(a.pid, sig)
        end = time.monotonic() + wait
        while time.monotonic() < end and any(a.poll() is None for a in agents):
            time.sleep(0.1)


def _outcome(config: RelaunchConfig, codes: list[int], watch: "AgentWatch", started: float) -> int:
    if all(c == 0 for c in codes):
        return ExitCode.OK
    if watch.ended_for_good():  # the agents were stopped for rank 0's permanent ending: their codes echo that stop
        return int(watch.rank0_exit["exit_code"])
    code = exit_code(config, next(c for c in codes if c != 0), started, reported=watch.worker_exit_code)
    if code == ExitCode.KILLED and watch.rank0_exit is not None:  # no record, but rank 0 said how it ended
        return int(watch.rank0_exit["exit_code"])
    return code


@dataclass
class AgentWatch:
    """Reads every agent's output: echoes it, feeds the progress bar, remembers restarts and failures."""

    reporter: "ProgressReporter"
    restarts: int = 0
    resumed: list[int] = field(default_factory=list)
    worker_exit_code: int | None = None
    rank0_exit: events.Event | None = None  # the latest attempt's exit event, when rank 0 wrote one
    tail: list[str] = field(default_factory=list)
    _attempts: set = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _readers: list[threading.Thread] = field(default_factory=list)

    def ended_for_good(self) -> bool:
        """Rank 0 of the latest attempt said it ended with a permanent code (bad input, an unwritable
        store, a divergence, a bug): restarting the group cannot help."""
        with self._lock:
            code = self.rank0_exit.get("exit_code") if self.rank0_exit is not None else None
        return isinstance(code, int) and code != ExitCode.OK and not is_retryable(code)

    def follow(self, proc: subprocess.Popen, node: int) -> None:
        self._readers.append(threading.current_thread())
        assert proc.stdout is not None
        for line in iter(proc.stdout.readline, ""):
            self.handle(line.rstrip("\n"), node)

    def handle(self, line: str, node: int) -> None:
        event = events.read(line)
        with self._lock:
            if event is not None:
                if event.kind == Kind.EXIT:
                    if isinstance(event.get("exit_code"), int):
                        self.rank0_exit = event
                elif event.kind == Kind.RESUMED:
                    self.rank0_exit = None  # a new attempt: an earlier one's ending no longer says anything
                    # attempt numbers count every start of this training; one that died before rank 0
                    # wrote leaves a gap, which is still a restart
                    self._attempts.add(int(event.get("attempt", len(self._attempts) + 1)))
                    self.restarts = max(self._attempts) - min(self._attempts)
                    self.resumed.append(int(event.get("step", -1)))
                self.reporter.event(event)
                if event.kind == Kind.PROGRESS:
                    return
            code = _TORCHRUN_EXITCODE.search(line)
            if code and self.worker_exit_code is None and int(code.group(1)) != 0:
                self.worker_exit_code = int(code.group(1))
            self.tail = (self.tail + [f"[node{node}] {line}"])[-40:]
        self.reporter.log(f"[node{node}] {line}")

    def failure_message(self, code: int) -> str:
        if self.rank0_exit is not None and self.rank0_exit.get("exit_code") == code and self.rank0_exit.get("reason"):
            return f"training ended with exit code {code}: {str(self.rank0_exit['reason'])[:300]}"
        interesting = [t for t in self.tail if "error" in t.lower() or "relaunch" in t.lower()]
        last = (interesting or self.tail or ["(no output)"])[-1]
        return f"training ended with exit code {code}: {last.strip()[:300]}"

    def close(self) -> None:
        for t in self._readers:
            t.join(5.0)
        self.reporter.close()


class ProgressReporter:
    """Where training progress goes: the ``relaunch run`` event file when ``RELAUNCH_EVENTS`` is set
    (the parent draws the bar), else a rich progress bar on a terminal, else a line per 10%."""

    def __init__(self, events_path: str | None):
        self.events_path = events_path
        self._bar = None
        self._task = None
        self._last_tenth = -1
        self._last_event = 0.0
        if not events_path and sys.stderr.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self._bar = Progress(TextColumn("training"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[info]}"), TimeRemainingColumn(), transient=False)
            self._bar.start()

    @classmethod
    def for_environment(cls) -> "ProgressReporter":
        return cls(os.environ.get(events.EVENTS_ENV))

    def event(self, event: events.Event) -> None:
        """Pass a training event on to the event file (progress at most four times a second), or
        draw it on the bar."""
        step, total = int(event.get("step", 0)), int(event.get("total_steps") or 0)
        progress = event.kind == Kind.PROGRESS
        throttled = progress and step != total and time.monotonic() - self._last_event < 0.25
        if self.events_path and not throttled:
            self._last_event = time.monotonic()
            events.write(event.kind, self.events_path, time=event.time, **event.fields)
        if not progress:
            return
        info = f"loss {event['loss']:.4f}" if isinstance(event.get("loss"), (int, float)) else ""
        if self._bar is not None:
            if self._task is None:
                self._task = self._bar.add_task("train", total=total or None, info=info)
            self._bar.update(self._task, completed=step, total=total or None, info=info)
        elif not self.events_path and total:
            tenth = step * 10 // total
            if tenth != self._last_tenth:
                self._last_tenth = tenth
                print(f"training: step {step}/{total} {info}", file=sys.stderr, flush=True)

    def log(self, line: str) -> None:
        if self._bar is not None:
            self._bar.console.print(line, markup=False, highlight=False)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
