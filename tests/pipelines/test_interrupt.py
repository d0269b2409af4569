"""Stopping ``relaunch run`` cleanly: SIGINT to the CLI process alone ends every process of the run with
one line and exit 130/143, and ``--resume`` finishes the training at once. Real processes throughout:
the CLI, kfp.local's steps, torchrun agents in their own sessions, workers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from relaunch.components.core.contract.exitcodes import ExitCode
from tests.cli import RELAUNCH

SHORT = ["--set", "train.hidden_size=32", "--set", "train.max_steps=60", "--set", "train.step_sleep_seconds=0.2",
         "--set", "train.checkpoint_every_steps=10", "--set", "launch.rdzv_port=0"]
"""The training's configuration; the resume gives none of it (the defaults would train 76 steps)."""
RUN_TIMEOUT = 420

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3 * RUN_TIMEOUT)]


def _start(cwd: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([RELAUNCH, "run", *args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def _training_started(cwd: Path) -> bool:
    for events in (cwd / ".relaunch" / "runs").rglob("events.jsonl"):
        for line in events.read_text().splitlines():
            if json.loads(line)["kind"] == "progress":
                return True
    return False


def _wait_for_training(proc: subprocess.Popen, cwd: Path) -> None:
    deadline = time.monotonic() + RUN_TIMEOUT  # a bound for a hang, not a timed assertion
    while not _training_started(cwd):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the training never started"
        time.sleep(0.2)


def _alive(processes: list[psutil.Process]) -> list[str]:
    left = []
    for p in processes:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{p.pid} {' '.join(p.cmdline())[:120]}")
        except psutil.NoSuchProcess:
            pass
    return left


def _interrupt(cwd: Path, send) -> tuple[int, str, str, list[psutil.Process], list[str]]:
    """A training of ``SHORT`` in ``cwd`` stopped, once it trains, by ``send(pid)`` (a signal to the CLI
    or its group); its exit code and output, the processes the run had started, and those still alive."""
    proc = _start(cwd, *SHORT)
    try:
        _wait_for_training(proc, cwd)
        run_processes = psutil.Process(proc.pid).children(recursive=True)
        send(proc.pid)
        out, err = proc.communicate(timeout=RUN_TIMEOUT)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    left = _alive(run_processes)
    for p in run_processes:  # never leave a stray trainer behind, whatever the assertions say
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    return proc.returncode, out, err, run_processes, left


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """A training stopped by SIGINT to the `relaunch run` process alone, then `relaunch run --resume`."""
    cwd = tmp_path_factory.mktemp("interrupted")
    stopped = _interrupt(cwd, lambda pid: os.kill(pid, signal.SIGINT))
    resumed = _start(cwd, "--resume")
    r_out, r_err = resumed.communicate(timeout=RUN_TIMEOUT)
    return (*stopped, (resumed.returncode, r_out, r_err, cwd))


def test_sigint_to_the_cli_alone_ends_with_one_line_and_exit_130_or_143(interrupted):
    code, out, err, _, _, _ = interrupted
    assert code in (ExitCode.INTERRUPTED, ExitCode.PREEMPTED), (code, out[-2000:], err[-3000:])
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert lines[0].startswith("relaunch: stopped by Ctrl-C (SIGINT)") and "--resume" in lines[0]
    assert ("committed" in lines[0]) == (code == ExitCode.PREEMPTED)


def test_sigint_to_the_cli_alone_leaves_no_process_of_the_run(interrupted):
    _, _, _, run_processes, left, _ = interrupted
    # two warm servers, the launch step, two torchrun agents (own sessions) and their two workers
    assert len(run_processes) >= 5, run_processes
    assert left == []


def test_resume_after_sigint_finishes_the_training_at_once(interrupted):
    code, out, err, _ = interrupted[-1]
    assert code == 0, (out[-3000:], err[-3000:])
    assert "resuming the training in" in out and "already committed" not in out + err


def test_the_resumed_training_keeps_its_own_configuration_in_the_summary_and_mlflow(interrupted):
    from mlflow.tracking import MlflowClient

    from relaunch.components.core.store import open_store
    from relaunch.components.core.store.records import read_summary
    from relaunch.components.core.store.trainings import training_names, training_uri

    cwd = interrupted[-1][-1]
    root = str(cwd / ".relaunch" / "store")
    (name,) = training_names(open_store(root))  # the resume continued it, no second training
    summary = read_summary(open_store(training_uri(root, name)))
    assert (summary["last_step"], summary["total_steps"], summary["exit_code"]) == (60, 60, 0)
    client = MlflowClient(f"sqlite:///{cwd}/.relaunch/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("relaunch").experiment_id])
    assert run.data.params["train.max_steps"] == "60" and run.data.params["train.hidden_size"] == "32"


def test_ctrl_c_in_a_terminal_signals_the_whole_foreground_group_and_still_ends_in_one_line(tmp_path):
    """A terminal's Ctrl-C sends SIGINT to the whole foreground process group (here: the group the
    CLI leads), the CLI, its warm servers and the launch step at once; torchrun agents are in their own
    sessions."""
    code, out, err, _, left = _interrupt(tmp_path, lambda pid: os.killpg(pid, signal.SIGINT))
    assert code in (ExitCode.INTERRUPTED, ExitCode.PREEMPTED), (out[-2000:], err[-3000:])
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err[-3000:]
    assert left == []
