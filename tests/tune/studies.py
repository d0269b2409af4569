"""What the slow tuning tests share: a small study of the default task (4 trials, 2 at once, 40 steps with
a checkpoint and a validation every 10), ``relaunch tune`` started as a user types it, and readers of a
study's folder and of the processes that work for it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from tests.cli import RELAUNCH, relaunch

REPO = Path(__file__).resolve().parents[2]
CHECKPOINT_EVERY = 10
STUDY = ["--config", str(REPO / "configs" / "tune.yaml"), "--set", "train.max_steps=40",
         "--set", f"train.checkpoint_every_steps={CHECKPOINT_EVERY}", "--set", "train.step_sleep_seconds=0.1",
         "--set", "tune.pruner.name=none", "--set", "launch.rdzv_port=0"]
"""Deterministic trainings of ~4 s each (a kill lands between two checkpoints); no pruner, so that which
trials run to their end does not depend on which finished first."""
OUTSIDE_TRACKING = ("MLFLOW_",)
"""What a study's ``relaunch tune`` runs without: MLflow's variables. ``MLFLOW_TRACKING_URI`` wins over
``tracking.uri``, and ``mlflow.set_tracking_uri`` in a test's process exports it: a study started after
such a test (pytest-xdist runs files one after the other in a worker) would track into that test's
database, not into its own cwd's ``.relaunch/mlflow.db`` that the tests read."""
STUDY_TIMEOUT = 420
WAIT_TIMEOUT = 240
"""A bound for a hang while a test waits for a study to reach a point, not a timed assertion."""


def tune(cwd: Path, *args: str, timeout: float = STUDY_TIMEOUT) -> subprocess.CompletedProcess:
    """``relaunch tune STUDY *args`` in ``cwd`` to its end."""
    return relaunch(cwd, "tune", *STUDY, *args, without=OUTSIDE_TRACKING, timeout=timeout)


def start_tune(cwd: Path, *args: str) -> subprocess.Popen:
    """``relaunch tune STUDY *args`` in ``cwd``, in a session of its own (a signal reaches it alone)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(OUTSIDE_TRACKING)}
    return subprocess.Popen([RELAUNCH, "tune", *STUDY, *args], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)


def study_dir(cwd: Path, study: str) -> Path:
    return cwd / ".relaunch" / "store" / "studies" / study


def trial_record(cwd: Path, study: str, n: int) -> dict:
    path = study_dir(cwd, study) / "trials" / str(n) / "trial.json"
    with contextlib.suppress(FileNotFoundError, ValueError):
        return json.loads(path.read_text())
    return {}


def committed_step(cwd: Path, study: str, n: int) -> int:
    """The step of trial ``n``'s latest committed checkpoint (-1: none)."""
    path = study_dir(cwd, study) / "trials" / str(n) / "checkpoints" / "latest.json"
    with contextlib.suppress(FileNotFoundError, ValueError):
        return int(json.loads(path.read_text())["step"])
    return -1


def attempts(cwd: Path, study: str, n: int) -> list[dict]:
    """Trial ``n``'s training attempt records, in order."""
    folder = study_dir(cwd, study) / "trials" / str(n) / "runs" / "attempts"
    return [json.loads(p.read_text()) for p in sorted(folder.glob("attempt-*.json"))]


def events(cwd: Path, study: str, n: int) -> list[dict]:
    """The events trial ``n``'s launch step passed on (its rank 0's ``resumed``, ``progress``, ``summary``...)."""
    path = study_dir(cwd, study) / "trials" / str(n) / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summary(cwd: Path, study: str, n: int) -> dict:
    return json.loads((study_dir(cwd, study) / "trials" / str(n) / "runs" / "summary.json").read_text())


def study_record(cwd: Path, study: str) -> dict:
    return json.loads((study_dir(cwd, study) / "study.json").read_text())


def processes_of(cwd: Path, study: str, n: int | None = None) -> list[psutil.Process]:
    """The live processes that train for the study (its trial ``n`` only, when given): those whose
    ``RELAUNCH_METRICS_FILE`` is in its folder."""
    folder = str(study_dir(cwd, study) / "trials") + "/"
    if n is not None:
        folder += f"{n}/"
    found = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if p.status() != psutil.STATUS_ZOMBIE and p.environ().get("RELAUNCH_METRICS_FILE", "").startswith(folder):
                found.append(p)
    return found


def worker_of(cwd: Path, study: str, n: int) -> psutil.Process | None:
    """Trial ``n``'s training worker (the torchrun child running ``relaunch.components.train``)."""
    for p in processes_of(cwd, study, n):
        with contextlib.suppress(psutil.Error):
            command = " ".join(p.cmdline())
            if "-m relaunch.components.train" in command and "torch.distributed.run" not in command:
                return p  # not its torchrun agent, whose command line ends with the worker's
    return None


def wait_for(what: str, condition, proc: subprocess.Popen | None = None, timeout: float = WAIT_TIMEOUT):
    """Poll ``condition`` until it returns something true; fail (stopping ``proc``) when it never does or
    ``proc`` ended first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        if proc is not None and proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"relaunch tune ended (exit {proc.returncode}) before {what}\n{out[-3000:]}\n{err[-2000:]}")
        time.sleep(0.1)
    if proc is not None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    pytest.fail(f"timed out waiting for {what}")


def values(cwd: Path, study: str, trials: int = 4) -> dict[int, tuple[str, float | None]]:
    """Each trial's state and objective value."""
    return {n: (trial_record(cwd, study, n).get("state"), trial_record(cwd, study, n).get("value")) for n in range(trials)}
