"""SIGKILL of ``relaunch run`` (the top process, nothing else): no process it started outlives it for more
than a moment (its guardian, pipelines/local/guardian.py, kills them all), whatever their depth and
session (warm servers, the launch step, torchrun agents, zygote clients, workers); ``relaunch trainings``
shows the training running before, interrupted after; the store is left as a commit left it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.cli import RELAUNCH, kill_agents

TRAINING = ["--set", "train.hidden_size=32", "--set", "train.max_steps=400", "--set", "train.step_sleep_seconds=0.1",
            "--set", "train.checkpoint_every_steps=5", "--set", "launch.rdzv_port=0"]
"""A training far longer than the test lets it run, saving often (a save is likely in flight when killed)."""
RUN_TIMEOUT = 420
ORPHAN_DEADLINE = 5.0
"""How long the run's processes may take to end after the kill: a bound for a hang, not a timed assertion
(they end within about 0.1 s here; before the guardian they trained on for 24-30 s)."""

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2 * RUN_TIMEOUT)]


def _committed_once(cwd: Path) -> bool:
    """Whether the training committed a checkpoint (a later save is then likely in flight when killed)."""
    return any((cwd / ".relaunch" / "store").glob("trainings/*/checkpoints/latest.json"))


def _alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    alive = []
    for p in processes:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except psutil.NoSuchProcess:
            pass
    return alive


def _is_trainer(p: psutil.Process | None, agent: str) -> bool:
    try:
        command = " ".join(p.cmdline()) if p is not None else ""
    except psutil.Error:
        return False
    return "-m relaunch.components.train " in command and agent not in command


def _trainings(cwd: Path) -> list[dict]:
    done = subprocess.run([RELAUNCH, "trainings", "--json", "--no-registry"], cwd=cwd, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


AGENTS = {"warm": "relaunch.components.launchers.inplace", "cold": "relaunch.components.launchers.inplace",
          "torchrun": "torch.distributed.run"}


@pytest.mark.parametrize("mode", ["warm", pytest.param("cold", marks=pytest.mark.ci_lane),
                                  pytest.param("torchrun", marks=pytest.mark.ci_lane)])  # the warm case in make test
def test_sigkill_of_relaunch_run_leaves_no_process_of_the_run_and_the_training_is_shown_interrupted(tmp_path, mode):
    """Warm (the default): forks of the warm servers, under the in-place agents of the memory tier; cold:
    every step, agent and worker a fresh interpreter under kfp.local's ``sh``, as on a cluster; torchrun:
    warm, the tier off, so torchrun's agents."""
    options = {"warm": [], "cold": ["--cold"], "torchrun": ["--set", "train.memory_tier=false"]}[mode]
    agent = AGENTS[mode]
    proc = subprocess.Popen([RELAUNCH, "run", *TRAINING, *options], cwd=tmp_path,
                            stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    tree: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + RUN_TIMEOUT  # a bound for a hang
        while not _committed_once(tmp_path):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the training never committed a checkpoint"
            time.sleep(0.2)
        (running,) = _trainings(tmp_path)
        assert running["state"] == "running", running
        tree = psutil.Process(proc.pid).children(recursive=True)
        commands = [" ".join(p.cmdline()) for p in _alive(tree)]
        assert sum(agent in c for c in commands) == 2, commands  # agents in their own sessions
        # warm in-place agents are forks of the full server too (through a zygote client); torchrun's and cold ones not
        assert [f"zygote_client.py -m {agent}" in c for c in commands if agent in c] == [mode == "warm"] * 2, commands
        if mode != "cold":  # two warm servers, the launch step, the agents (warm: their clients and forks), two
            # zygote clients and their two workers (forks of the full server), and the guardian
            assert sum("zygote_client.py" in c and agent not in c for c in commands) == 2, commands
            assert len(commands) >= 9, commands
        else:  # kfp.local's sh, the launch step, the agents, their workers (and theirs: loader workers, forks
            # with the same command line, whose parent is a worker), and the guardian
            trainers = [p for p in _alive(tree) if _is_trainer(p, agent) and not _is_trainer(p.parent(), agent)]
            assert len(trainers) == 2, commands
        os.kill(proc.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        proc.wait()
        left = _alive(tree)
        while left and time.monotonic() - killed_at < ORPHAN_DEADLINE:
            time.sleep(0.05)
            left = _alive(tree)
        measured = time.monotonic() - killed_at
        print(f"the run's {len(tree)} processes ended {measured:.2f}s after the SIGKILL", file=sys.stderr)
        assert left == [], [f"{p.pid} {' '.join(p.cmdline())[:150]}" for p in left]
    finally:
        for p in _alive(tree):  # never leave a stray trainer behind, whatever the assertions say
            p.kill()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        kill_agents(tmp_path)
    (stopped,) = _trainings(tmp_path)
    assert stopped["state"] == "interrupted", stopped
    from relaunch.components.core.checkpoint import CheckpointManager
    from relaunch.components.core.store import open_store

    with CheckpointManager(open_store(stopped["uri"]), async_save=False) as manager:  # the newest commit is whole
        newest = manager.latest()
        assert newest is not None and newest.step == stopped["step"]
        manager.verify(newest.step, deep=True)  # raises on a damaged checkpoint
