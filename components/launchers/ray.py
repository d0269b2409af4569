"""Launch backend ``ray``: the training on a Ray cluster that relaunch starts on this machine and owns.

    relaunch run --set launch.backend=ray                           # the whole pipeline
    python -m relaunch.components.launchers.ray drive --address HOST:PORT --job-id ID --config-json '{...}'

What runs (``pip install 'relaunch[ray]'``; ``ray`` is imported only inside the functions that need it):

1. A Ray head of its own (``ray start --head --block``, a process group this launcher started and stops
   by its PID), with token authentication as a user sets it up: a fresh token in a 0600 file of the
   cluster's own directory, named by ``RAY_AUTH_TOKEN_PATH`` with ``RAY_AUTH_MODE=token`` for the head
   and every client. Nothing is written to ``~/.ray``.
2. The driver (``drive`` above; on a cluster, the RayJob's entrypoint): one Ray actor per rank, placed
   by a placement group of one bundle per node. Each actor runs relaunch's training entrypoint
   (``python -m relaunch.components.train``) as a child process with torchrun's environment (rank, world,
   the rendezvous on rank 0's node, the restart count), so the trainer is the torchrun path's: the same
   store, checkpoint commits, one MLflow run across restarts, SIGTERM handling and exit codes.

Why actors that re-exec relaunch's worker rather than Ray Train's TorchTrainer: TorchTrainer's recovery
tears down and rebuilds its worker group and took ~19 s from a killed worker to resumed training here,
against ~2 s for torchrun's cold restart; it also owns checkpoints (``ray.train.report``) and the exit
status. Here a failed rank is seen within one poll, its peers are killed, and the same actors start the
next round of trainer processes at once. Ray's own failure policy covers the actors: each is created with
``max_restarts=launch.max_restarts``, so a Ray worker process that dies is started again by Ray, and the
driver restarts the training round at most ``launch.max_restarts`` times. A permanent exit code (bad input
2, divergence 3, a bug 1) ends the training at once, never retried.

The launcher reads the driver's output as the local launcher reads torchrun's agents (rank 0's events
feed the progress bar and the run's event file) and its exit status is already the contract's code.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import importlib.util
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ..core.contract.config import RelaunchConfig
from ..core.contract.config_loading import config_from_cli
from ..core.contract.errors import BadInput, Preempted
from ..core.contract.exitcodes import PERMANENT, ExitCode, is_retryable, normalize
from ..core.runtime.net import free_port
from ..core.runtime.wiring import wire
from ..core.store.procfs import boot_ticks, exited, processes
from . import LaunchResult
from .jobs import JobSpec, job_spec
from .local import STOP_MARGIN_SECONDS, AgentWatch, ProgressReporter, start_agent, wait_agents

HEAD_START_SECONDS = 90.0  # from ``ray start`` to a head that accepts clients
HEAD_STOP_SECONDS = 10.0  # from SIGTERM to SIGKILL of the head's process group
GROUP_GONE_SECONDS = 30.0  # at most, from the head's end to the last of its group reaped
POLL_SECONDS = 0.05  # how often the driver asks the actors for output and exit status
PEER_STOP_SECONDS = 10.0  # once a rank failed: how long its killed peers get to be reaped
ACTOR_BACK_SECONDS = 120.0  # at most, from a round's failure to every actor Ray restarts answering again
ACTOR_BACK_POLL_SECONDS = 0.2
AUTH_ENV = {"RAY_AUTH_MODE": "token"}
TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"
READY_LINE = "Ray runtime started"
HEAD_UP = "relaunch[ray]: local Ray head up in"  # what the launcher and the driver say of their start-up (make bench)
ACTORS_READY = "relaunch[ray]: connected,"
NEEDS_RAY = "launch.backend=ray needs Ray on this machine: pip install 'relaunch[ray]' (ray[train]==2.60.0)"
_PR_SET_PDEATHSIG = 1  # prctl(2)


def group_members(pgid: int, started_before: int) -> list[int]:
    """The processes of group ``pgid`` started before ``started_before`` (:func:`boot_ticks`) that
    have not exited, from ``/proc``: the group as it was, not a later one that reused the number; a
    zombie has ended (its new parent, PID 1 or a subreaper, reaps it when it will). Without ``/proc``,
    every process ``killpg`` still reaches counts (``[pgid]`` while the group answers)."""
    if not os.path.isdir("/proc/self"):
        try:
            os.killpg(pgid, 0)
            return [pgid]
        except ProcessLookupError:
            return []
    return [pid for pid, fields in processes()  # fields: pgrp, starttime
            if not exited(fields) and int(fields[2]) == pgid and int(fields[19]) < started_before]


class LocalRayCluster:
    """A Ray head on 127.0.0.1 started and stopped by this process (a context manager).

    ``address`` is what clients pass to ``ray.init``; ``env`` is what they need in their environment
    (the token's mode and path). ``started_seconds`` is how long the head took to accept clients.
    """

    def __init__(self, num_cpus: int, num_gpus: int = 0) -> None:
        self.num_cpus, self.num_gpus = num_cpus, num_gpus
        self.directory = Path(tempfile.mkdtemp(prefix="rl-ray-", dir="/tmp"))  # short: Ray's socket paths
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        token = self.directory / "auth_token"
        token.touch(mode=0o600)
        token.write_text(secrets.token_hex(32))
        self.env = {**AUTH_ENV, TOKEN_PATH_ENV: str(token)}
        self.proc: subprocess.Popen | None = None
        self.started_seconds = 0.0
        self.stopping = 0  # boot_ticks() when the stop began

    def __enter__(self) -> "LocalRayCluster":
        started = time.monotonic()
        log = open(self.directory / "head.log", "w+")  # noqa: SIM115 - lives as long as the head
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RELAUNCH_EVENTS"))}
        env.update(self.env, RAY_USAGE_STATS_ENABLED="0")
        ray_cli = Path(sys.executable).with_name("ray")  # the ``ray`` command of this interpreter's installation
        cli = [str(ray_cli)] if ray_cli.exists() else [sys.executable, "-c", "from ray.scripts.scripts import main; main()"]
        command = [*cli, "start", "--head", "--block",
                   f"--port={self.port}", "--node-ip-address=127.0.0.1", f"--num-cpus={self.num_cpus}",
                   f"--num-gpus={self.num_gpus}", "--include-dashboard=false", "--disable-usage-stats",
                   f"--temp-dir={self.directory / 'session'}"]
        self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            while READY_LINE not in (self.directory / "head.log").read_text(errors="replace"):
                if self.proc.poll() is not None or time.monotonic() - started > HEAD_START_SECONDS:
                    tail = (self.directory / "head.log").read_text(errors="replace")[-1500:]
                    raise RuntimeError(f"the local Ray head did not start (exit {self.proc.poll()}): {tail}")
                time.sleep(0.1)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        self.started_seconds = time.monotonic() - started
        return self

    def __exit__(self, *exc) -> None:
        self.stopping = boot_ticks()
        if self.proc is not None:
            for sig, wait in ((signal.SIGTERM, HEAD_STOP_SECONDS), (signal.SIGKILL, 5.0)):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, sig)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(wait)
                    break
            # what ``ray start --block`` left of its group (GCS, raylet, workers) goes with it; until no
            # member runs (5 s was short on a loaded machine for a killed worker to exit). Its members
            # are told by their start time too: once the group is gone its number may be a new,
            # unrelated group's (pid_max is 32768 on many hosts), which must not be killed
            end = time.monotonic() + GROUP_GONE_SECONDS
            with contextlib.suppress(ProcessLookupError):
                while group_members(self.proc.pid, self.stopping) and time.monotonic() < end:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                    time.sleep(0.05)
        shutil.rmtree(self.directory, ignore_errors=True)


def driver_command(spec: JobSpec, *, address: str, job_id: str, python: str = sys.executable) -> list[str]:
    """The driver's command line (side-effect free): the local launcher's child, the RayJob's entrypoint."""
    return [python, "-u", "-m", __name__, "drive", "--address", address, "--job-id", job_id,
            "--config-json", spec.config_json]


def launch(config: RelaunchConfig, *, pipeline_run_id: str, resume_from: str | None) -> LaunchResult:
    """Start a Ray cluster on this machine, run the training's driver on it to the end, stop the cluster."""
    if importlib.util.find_spec("ray") is None:
        return LaunchResult(ExitCode.BAD_INPUT, NEEDS_RAY)
    config = config.model_copy(deep=True)
    if resume_from:
        config.train.resume_from = resume_from
    job_id = re.sub(r"[^a-zA-Z0-9-]", "-", f"{config.name}-{pipeline_run_id or 'manual'}")[:60]
    spec = job_spec(config)
    world = spec.nodes * spec.procs_per_node
    started = time.time()
    watch = AgentWatch(ProgressReporter.for_environment())
    try:
        with LocalRayCluster(num_cpus=max(world, os.cpu_count() or 1)) as cluster:
            watch.reporter.log(f"{HEAD_UP} {cluster.started_seconds:.1f} s at {cluster.address} (token auth)")
            driver = start_agent(driver_command(spec, address=cluster.address, job_id=job_id), 0, cluster.env)
            threading.Thread(target=watch.follow, args=(driver, 0), daemon=True, name="ray-driver-reader").start()
            try:
                codes, timed_out = wait_agents([driver], config.launch.timeout_seconds,
                                         config.train.preempt_grace_seconds + STOP_MARGIN_SECONDS)
            finally:
                watch.close()
    except RuntimeError as err:  # the head would not start: the machine may be busy, try again
        return LaunchResult(ExitCode.RETRY_ME, str(err), duration_seconds=time.time() - started, job_name=job_id)
    duration = time.time() - started
    if timed_out:
        return LaunchResult(ExitCode.RETRY_ME, f"training did not finish within launch.timeout_seconds="
                            f"{config.launch.timeout_seconds:g}; stopped it", watch.restarts, watch.resumed, duration, job_id)
    code = normalize(codes[0])
    message = "" if code == 0 else watch.failure_message(code)
    return LaunchResult(code, message, watch.restarts, watch.resumed, duration, job_id)


# --------------------------------------------------------------------------- the driver and its actors


def _die_with_parent() -> None:
    """In the trainer child: SIGKILL when its actor dies, so a killed Ray worker leaves no rank behind."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class RankActor:
    """One rank of the training as a Ray actor: starts relaunch's trainer as its child, one per round,
    and hands its output and exit status to the driver."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.lines: collections.deque[str] = collections.deque()
        self.reader: threading.Thread | None = None

    def rendezvous(self) -> tuple[str, int]:
        """This node's address and a free port on it: rank 0's actor hosts the round's store."""
        import ray

        return ray.util.get_node_ip_address(), free_port()

    def start(self, module: str, config_json: str, env: dict[str, str], cwd: str) -> int:
        """Start this round's trainer; its pid."""
        command = [sys.executable, "-u", "-m", module, "--config-json", config_json]
        self.lines.clear()
        self.proc = subprocess.Popen(command, env={**os.environ, **env}, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, bufsize=1,
                                     cwd=cwd if os.path.isdir(cwd) else None, preexec_fn=_die_with_parent)
        self.reader = threading.Thread(target=self._read, args=(self.proc,), daemon=True)
        self.reader.start()
        return self.proc.pid

    def _read(self, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in iter(proc.stdout.readline, ""):
            self.lines.append(line.rstrip("\n"))

    def poll(self) -> tuple[list[str], int | None]:
        """The trainer's output since the last poll, and its exit status once it ended and all is read."""
        out = []
        while self.lines:
            out.append(self.lines.popleft())
        if self.proc is None or self.proc.poll() is None or (self.reader is not None and self.reader.is_alive()):
            return out, None
        while self.lines:
            out.append(self.lines.popleft())
        return out, self.proc.returncode

    def signal(self, signum: int) -> None:
        """Send ``signum`` to the trainer, if it still runs."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signum)


class _Driver:
    """Rounds of the training on the actors: start every rank, watch, and on a failure restart or stop."""

    def __init__(self, config: RelaunchConfig, job_id: str) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.ray = ray
        self.config, self.job_id, self.spec = config, job_id, job_spec(config)
        spec = self.spec
        self.world = spec.nodes * spec.procs_per_node
        bundle = {"CPU": float(spec.procs_per_node), **({"GPU": float(spec.resources.gpus)} if spec.resources.gpus else {})}
        self.group = placement_group([dict(bundle) for _ in range(spec.nodes)], strategy="SPREAD")
        ray.get(self.group.ready(), timeout=120)
        actor = ray.remote(RankActor)
        gpus = spec.resources.gpus / spec.procs_per_node if spec.resources.gpus else 0
        self.actors = [actor.options(
            num_cpus=1, num_gpus=gpus, max_restarts=spec.restart.max_restarts, max_task_retries=0, max_concurrency=4,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=rank // spec.procs_per_node),
        ).remote() for rank in range(self.world)]
        self.preempted = False

    def run(self) -> int:
        restarts = 0
        while True:
            code = self._round(restarts)
            if code == 0 or self.preempted or not is_retryable(code) or restarts >= self.spec.restart.max_restarts:
                return code
            restarts += 1
            print(f"relaunch[ray]: a rank ended with retryable {code}; restarting the training "
                  f"({restarts}/{self.spec.restart.max_restarts})", file=sys.stderr, flush=True)

    def _env(self, rank: int, host: str, port: int, restarts: int) -> dict[str, str]:
        ppn = self.spec.procs_per_node
        return {"RANK": str(rank), "WORLD_SIZE": str(self.world), "LOCAL_RANK": str(rank % ppn),
                "LOCAL_WORLD_SIZE": str(ppn), "GROUP_RANK": str(rank // ppn), "MASTER_ADDR": host,
                "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": str(restarts),
                "TORCHELASTIC_MAX_RESTARTS": str(self.spec.restart.max_restarts),
                "TORCHELASTIC_RUN_ID": self.job_id, "RELAUNCH_NODE": str(rank // ppn), "PYTHONUNBUFFERED": "1"}

    def _actors_back(self) -> bool:
        """Whether every actor answers within :data:`ACTOR_BACK_SECONDS`: one whose Ray worker was killed
        refuses calls (``ActorUnavailableError``) while Ray restarts it, a few seconds."""
        ray = self.ray
        deadline = time.monotonic() + ACTOR_BACK_SECONDS
        while True:
            try:
                ray.get([a.rendezvous.remote() for a in self.actors])
                return True
            except ray.exceptions.ActorUnavailableError:
                if time.monotonic() > deadline:
                    return False
                time.sleep(ACTOR_BACK_POLL_SECONDS)

    def _round(self, restarts: int) -> int:
        """One round: every rank started, watched to its end. The contract's code of the round."""
        ray = self.ray
        if restarts and not self._actors_back():
            print(f"relaunch[ray]: a rank actor Ray restarts did not answer within {ACTOR_BACK_SECONDS:g} s",
                  file=sys.stderr, flush=True)
            return int(ExitCode.RETRY_ME)
        host, port = ray.get(self.actors[0].rendezvous.remote())
        ray.get([a.start.remote(self.spec.module, self.spec.config_json, self._env(rank, host, port, restarts), os.getcwd())
                 for rank, a in enumerate(self.actors)])
        codes: dict[int, int] = {}
        failed: dict[int, int] = {}
        peers_stopped_at: float | None = None
        while len(codes) < self.world:
            polls = [a.poll.remote() for rank, a in enumerate(self.actors) if rank not in codes]
            ranks = [rank for rank in range(self.world) if rank not in codes]
            for rank, ref in zip(ranks, polls):
                try:
                    lines, code = ray.get(ref)
                except ray.exceptions.RayActorError:  # the Ray worker died (its trainer with it); Ray restarts it
                    lines, code = [], int(ExitCode.KILLED)
                for line in lines:
                    if rank == 0 or "relaunch" in line.lower() or "error" in line.lower():
                        print(line if rank == 0 else f"[rank{rank}] {line}", flush=True)
                if code is not None:
                    codes[rank] = normalize(code)
                    if codes[rank] != 0 and peers_stopped_at is None:
                        failed[rank] = codes[rank]
            if failed and peers_stopped_at is None:
                peers_stopped_at = time.monotonic()
                if not self.preempted:  # a rank is gone: its peers' state is lost, the round ends now
                    for rank, a in enumerate(self.actors):
                        if rank not in codes:
                            a.signal.remote(signal.SIGKILL)
            if peers_stopped_at is not None and time.monotonic() - peers_stopped_at > PEER_STOP_SECONDS + (
                    self.spec.grace_seconds + STOP_MARGIN_SECONDS if self.preempted else 0):
                break
            time.sleep(POLL_SECONDS)
        if not failed:
            return 0 if all(c == 0 for c in codes.values()) else int(ExitCode.KILLED)
        permanent = [code for code in failed.values() if code in PERMANENT]  # one rank's bad input ends it for good
        return permanent[0] if permanent else failed[min(failed)]

    def preempt(self, signum, frame) -> None:
        """SIGTERM: pass it to every trainer; they agree on a checkpoint and exit 143."""
        self.preempted = True
        for a in self.actors:
            a.signal.remote(signal.SIGTERM)


def drive(config: RelaunchConfig, *, address: str, job_id: str) -> int:
    """Run the training on the Ray cluster at ``address`` to its end; the contract's exit code."""
    try:
        import ray
    except ImportError:
        raise BadInput(NEEDS_RAY) from None
    began = time.monotonic()
    try:
        ray.init(address=address, logging_level="ERROR", log_to_driver=False, configure_logging=False)
    except ray.exceptions.AuthenticationError as err:
        raise BadInput(f"the Ray cluster at {address} refused our token ({type(err).__name__}); set "
                       f"{TOKEN_PATH_ENV} to the cluster's token file (or RAY_AUTH_TOKEN)") from None
    except (ConnectionError, TimeoutError) as err:
        print(f"relaunch[ray]: cannot reach the Ray cluster at {address}: {err}", file=sys.stderr, flush=True)
        return int(ExitCode.RETRY_ME)
    try:
        driver = _Driver(config, job_id)
        ray.get([a.rendezvous.remote() for a in driver.actors])
        print(f"{ACTORS_READY} {driver.world} rank actors ready in {time.monotonic() - began:.1f} s", flush=True)
        signal.signal(signal.SIGTERM, driver.preempt)
        return driver.run()
    finally:
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    """``drive``: the driver of a training on a running Ray cluster (the RayJob's entrypoint)."""
    wire()
    parser = argparse.ArgumentParser(prog=f"python -m {__name__}", description=main.__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("drive")
    d.add_argument("--address", default=os.environ.get("RAY_ADDRESS", "auto"))
    d.add_argument("--job-id", default=os.environ.get("RELAUNCH_JOB_ID", "ray"))
    d.add_argument("--config", help="YAML configuration file")
    d.add_argument("--config-json", help="the whole configuration as JSON")
    d.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    try:
        config = config_from_cli(args.config, args.config_json, args.overrides)
        return drive(config, address=args.address, job_id=args.job_id)
    except BadInput as err:
        print(f"relaunch[ray]: {err}", file=sys.stderr, flush=True)
        return int(ExitCode.BAD_INPUT)
    except Preempted:
        return int(ExitCode.PREEMPTED)


if __name__ == "__main__":
    sys.exit(main())
