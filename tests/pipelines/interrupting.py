"""Helpers of the tests that stop ``relaunch run`` (tests/pipelines/test_interrupt.py and
test_processes_interrupt_code.py): a short training, its start and end, what it left."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil

from tests.cli import RELAUNCH, kill_agents

SHORT = ["--set", "train.hidden_size=32", "--set", "train.max_steps=60", "--set", "train.step_sleep_seconds=0.2",
         "--set", "train.checkpoint_every_steps=10", "--set", "launch.rdzv_port=0"]
"""The training's configuration; the resume gives none of it (the defaults would train 76 steps)."""
RUN_TIMEOUT = 420


def start(cwd: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([RELAUNCH, "run", *args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def wait_for_step(proc: subprocess.Popen, cwd: Path, step: int) -> None:
    """Until the run's progress events reach ``step`` (a hang or an early end fails the test)."""
    _wait(proc, lambda: steps_trained(cwd) >= step, f"the training never reached step {step}", poll=0.1)


def wait_for_save(proc: subprocess.Popen, cwd: Path, step: int) -> None:
    """Until the run's events say the checkpoint of ``step`` is being written (a hang or an early end fails
    the test); polled often: the moment it starts is the one a test aims at."""
    _wait(proc, lambda: saving(cwd, step), f"the training never saved step {step}", poll=0.02)


def _wait(proc: subprocess.Popen, reached, never: str, poll: float) -> None:
    deadline = time.monotonic() + RUN_TIMEOUT  # a bound for a hang, not a timed assertion
    while not reached():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, never
        time.sleep(poll)


def alive(processes: list[psutil.Process]) -> list[str]:
    left = []
    for p in processes:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{p.pid} {' '.join(p.cmdline())[:120]}")
        except psutil.NoSuchProcess:
            pass
    return left


def interrupt(cwd: Path, send, at_step: int = 1, at_save: int | None = None
              ) -> tuple[int, str, str, list[psutil.Process], list[str]]:
    """A training of ``SHORT`` in ``cwd`` stopped by ``send(pid)`` (a signal to the CLI or its
    group) once it trained ``at_step`` steps or, given ``at_save``, as the checkpoint of that step starts
    being written; its exit code and output, the processes the run had started, and those still alive
    (every one of them is killed before this returns)."""
    proc = start(cwd, *SHORT)
    try:
        if at_save is None:
            wait_for_step(proc, cwd, at_step)
        else:
            wait_for_save(proc, cwd, at_save)
        run_processes = psutil.Process(proc.pid).children(recursive=True)
        send(proc.pid)
        out, err = proc.communicate(timeout=RUN_TIMEOUT)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    left = alive(run_processes)
    for p in run_processes:  # never leave a stray trainer behind, whatever the assertions say
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    return proc.returncode, out, err, run_processes, left


def steps_trained(cwd: Path) -> int:
    """The newest step the run's progress events reached (0 before the first)."""
    newest = 0
    for path in (cwd / ".relaunch" / "runs").rglob("events.jsonl"):
        for line in path.read_text().splitlines():
            event = json.loads(line) if line.strip() else {}
            if event.get("kind") == "progress":
                newest = max(newest, int(event["step"]))
    return newest


def saving(cwd: Path, step: int) -> bool:
    """Whether the run's event file says a checkpoint of ``step`` is being written."""
    for path in (cwd / ".relaunch" / "runs").rglob("events.jsonl"):
        for line in path.read_text().splitlines():
            event = json.loads(line) if line.strip() else {}
            if event.get("kind") == "saving" and event.get("step") == step:
                return True
    return False


def finish(proc: subprocess.Popen, cwd: Path) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=RUN_TIMEOUT)
    finally:
        kill_run(proc, cwd)
    return proc.returncode, out, err


def kill_run(proc: subprocess.Popen, cwd: Path) -> None:
    """If the run still runs: SIGKILL it, its group and its torchrun agents (their own sessions)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        kill_agents(cwd)


def trainings(cwd: Path) -> dict:
    done = subprocess.run([RELAUNCH, "trainings", "--json"], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    (training,) = json.loads(done.stdout)
    return training


def mlflow_run(cwd: Path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{cwd}/.relaunch/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("relaunch").experiment_id])
    return run
