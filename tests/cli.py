"""``relaunch run`` as a user types it, for the end-to-end tests: the console script of this interpreter,
a small training, its own process group, and nothing left running when it hangs."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests import warm_processes

RELAUNCH = str(Path(sys.executable).parent / "relaunch")
TINY = ["--set", "train.hidden_size=32", "--set", "train.checkpoint_every_steps=10", "--set", "launch.rdzv_port=0"]
SHARED_OFF_ENV = "RELAUNCH_TEST_OWN_SERVERS"
"""``RELAUNCH_TEST_OWN_SERVERS=1``: every ``relaunch run`` starts its own warm servers, as a user's does."""
RUN_TIMEOUT = 420  # one `relaunch run` of a few dozen steps takes 1-3 min on 2 busy cores


def relaunch_run(cwd: Path, *args: str, env: dict | None = None, without: tuple[str, ...] = (),
                 timeout: float = RUN_TIMEOUT, shared: bool = True) -> subprocess.CompletedProcess:
    """``relaunch run TINY *args`` in ``cwd``, with this process's environment less the variables that start
    with a prefix in ``without``, plus ``env``; a hang past ``timeout`` kills the run, its agents, and fails.
    ``shared``: the run forks its steps from the session's shared warm servers (tests/warm_processes.py)
    instead of starting its own; each step still gets this run's environment and working directory."""
    if shared and "--cold" not in args and os.environ.get(SHARED_OFF_ENV) != "1":
        env = {**warm_processes.shared_steps_env(), **(env or {})}
    return relaunch(cwd, "run", *TINY, *args, env=env, without=without, timeout=timeout)


def relaunch(cwd: Path, *args: str, env: dict | None = None, without: tuple[str, ...] = (),
             timeout: float = RUN_TIMEOUT) -> subprocess.CompletedProcess:
    """``relaunch *args`` in ``cwd`` as :func:`relaunch_run` runs it (any command line, as a user types it)."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith(without)} if without else dict(os.environ)
    proc = subprocess.Popen([RELAUNCH, *args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**environ, **(env or {})}, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        kill_agents(cwd)  # a shared server's steps too: they work in ``cwd``
        out, err = proc.communicate()
        pytest.fail(f"relaunch {args[0]} did not finish in {timeout:.0f} s; log under {cwd}/.relaunch/runs\n{out[-2000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def kill_agents(cwd: Path) -> None:
    """torchrun agents live in their own sessions: find ours by working directory and stop them."""
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{pid}/cwd") == str(cwd):
                    os.kill(int(pid), signal.SIGKILL)


def newest_training(root: str) -> str:
    """The store URI of the newest training ``relaunch run`` started under the store ``root``."""
    from relaunch.components.core.store import open_store
    from relaunch.components.core.store.training_folders import training_names, training_uri

    names = training_names(open_store(root))
    assert names, f"no training under {root}"
    return training_uri(root, names[-1])
