"""The in-place agent with stand-in workers (:mod:`tests.launchers.inplace_worker`): a killed worker is
replaced while the others keep their processes (in the same generation when it was lost before it entered
that generation's rendezvous, which still waits for it; else in a new one); any other failure takes the whole-group path and its
code; a SIGTERM of the agent reaches the workers and ends it with their code, restarting nothing. Across
agents of two nodes sharing node 0's store: a worker killed on one node is replaced by its agent while
every other rank, on both nodes, keeps its process; one node's bad input ends both with its code; a node
lost whole and started again rejoins with all of its ranks; node 0 lost ends the other with 138.

The agents start warm, as ``relaunch run`` starts them (forks of the session's zygote, their workers and
replacements forks too); .ci/run's cold lane runs this file again with every process a fresh interpreter."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from relaunch.components.core.runtime.net import free_port
from relaunch.components.launchers.inplace import _dying
from tests import warm_processes

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # agents and their workers: .ci/run's cold lane selects these by it


def start(mode: str, nproc: int = 3, max_restarts: int = 1) -> subprocess.Popen:
    """The agent as relaunch run starts it: warm (a fork of the session's zygote, its workers forks too)
    unless the tests run cold."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    warm = [] if warm_processes.cold() else ["--warm"]
    return warm_processes.popen([sys.executable, "-m", "relaunch.components.launchers.inplace", *warm,
                                 f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}", "-m",
                                 "tests.launchers.inplace_worker", mode],
                                cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_a_killed_worker_is_replaced_and_the_others_keep_their_processes():
    agent = start("kill")
    out, _ = agent.communicate(timeout=120)
    assert agent.returncode == 0, out
    first = dict(re.findall(r"worker rank=(\d) pid=(\d+) generation=0", out))
    rejoined = dict(re.findall(r"worker rank=(\d) pid=(\d+) rejoined generation=1", out))
    assert rejoined == {"0": first["0"], "2": first["2"]}, out  # survivors: the same processes, next generation
    replacement = re.findall(r"worker rank=1 pid=(\d+) generation=1", out)
    assert replacement and replacement[0] != first["1"], out
    assert "rank 1 (pid" in out and "killed (-9)" in out


def test_a_replacement_lost_before_it_entered_the_rendezvous_is_replaced_in_the_same_generation():
    agent = start("lost-before-joining", max_restarts=2)
    out, _ = agent.communicate(timeout=120)
    assert agent.returncode == 0, out
    replacements = re.findall(r"worker rank=1 pid=(\d+) generation=1", out)
    assert len(set(replacements)) == 2, out  # the first replacement, lost, and its own
    assert "generation=2" not in out, out  # the survivors' rendezvous of generation 1 still waited for rank 1
    assert "whose rendezvous still waits for the rank" in out, out
    first = dict(re.findall(r"worker rank=([02]) pid=(\d+) generation=0", out))
    assert dict(re.findall(r"worker rank=([02]) pid=(\d+) rejoined generation=1", out)) == first, out


def test_a_replacement_lost_after_it_entered_the_rendezvous_is_replaced_in_a_new_generation():
    agent = start("lost-after-joining", max_restarts=2)
    out, _ = agent.communicate(timeout=120)
    assert agent.returncode == 0, out
    assert len(re.findall(r"worker rank=1 pid=\d+ generation=1", out)) == 1, out
    assert re.search(r"worker rank=1 pid=\d+ generation=2", out), out  # its address may be in 1's: a new round
    first = dict(re.findall(r"worker rank=([02]) pid=(\d+) generation=0", out))
    assert dict(re.findall(r"worker rank=([02]) pid=(\d+) rejoined generation=2", out)) == first, out


def test_a_bad_input_of_one_worker_stops_the_group_with_its_code_and_restarts_nothing():
    agent = start("bad")
    out, _ = agent.communicate(timeout=120)
    assert agent.returncode == 2, out
    assert "generation=1" not in out and "rank 1 ended with 2: stopping the group" in out


def test_a_sigterm_of_the_agent_reaches_every_worker_and_ends_it_with_their_code():
    agent = start("preempt", nproc=2)
    deadline = time.monotonic() + 60
    seen = ""
    while seen.count("worker rank=") < 2 and time.monotonic() < deadline:
        seen += agent.stdout.readline()
    time.sleep(0.5)  # both installed their handlers
    agent.send_signal(signal.SIGTERM)
    out, _ = agent.communicate(timeout=60)
    assert agent.returncode == 143, seen + out
    assert "generation=1" not in seen + out


def test_a_worker_killed_but_not_yet_reaped_counts_as_dying_and_a_running_one_does_not():
    proc = subprocess.Popen(["sleep", "30"])
    try:
        time.sleep(0.05)
        assert not _dying(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)
        assert _dying(proc.pid)  # its SIGKILL pending, exiting, or a zombie: the agent waits for it
    finally:
        proc.kill()
        proc.wait()
    assert not _dying(proc.pid)  # reaped: gone from /proc


def start_node(node: int, port: int, *worker: str, nproc: int = 2) -> subprocess.Popen:
    """Node ``node`` of two, its own session (what a pod is): node 0's agent hosts the store on ``port``."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
    warm = [] if warm_processes.cold() else ["--warm"]  # killing its client (the pod) kills the fork's group
    return warm_processes.popen([sys.executable, "-m", "relaunch.components.launchers.inplace", *warm,
                                 f"--nproc-per-node={nproc}", "--max-restarts=1", "--nnodes=2", f"--node-rank={node}",
                                 "--master-addr=127.0.0.1", f"--master-port={port}", "--node-address=127.0.0.1", "-m",
                                 "tests.launchers.inplace_worker", *worker],
                                cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)


def ended(*agents: subprocess.Popen, timeout: float = 120) -> tuple[list[int], str]:
    outs = [a.communicate(timeout=timeout)[0] for a in agents]
    return [a.returncode for a in agents], "\n".join(f"--- node {i}\n{o}" for i, o in enumerate(outs))


def read_until(agent: subprocess.Popen, count: int, what: str = "worker rank=", timeout: float = 60) -> str:
    deadline, seen = time.monotonic() + timeout, ""
    while seen.count(what) < count and time.monotonic() < deadline:
        seen += agent.stdout.readline()
    return seen


def test_a_worker_killed_on_one_node_is_replaced_there_and_every_other_rank_on_both_nodes_keeps_its_process():
    port = free_port()
    agents = [start_node(node, port, "kill", "3") for node in (0, 1)]
    codes, out = ended(*agents)
    assert codes == [0, 0], out
    first = dict(re.findall(r"worker rank=(\d) pid=(\d+) generation=0", out))
    rejoined = dict(re.findall(r"worker rank=(\d) pid=(\d+) rejoined generation=1", out))
    assert rejoined == {r: first[r] for r in "012"}, out  # node 0's two and node 1's survivor: the same processes
    replacement = re.findall(r"worker rank=3 pid=(\d+) generation=1", out)
    assert replacement and replacement[0] != first["3"], out
    node1 = out.split("--- node 1")[1]
    assert "rank 3 (pid" in node1 and "replacement pid" in node1  # its own node's agent replaced it


def test_a_bad_input_on_one_node_ends_every_node_with_its_code_and_restarts_nothing():
    port = free_port()
    agents = [start_node(node, port, "bad", "3") for node in (0, 1)]
    codes, out = ended(*agents)
    assert codes == [2, 2], out
    assert "generation=1" not in out and "another node ended the job with 2" in out.split("--- node 1")[0]


def two_waiting_nodes() -> tuple[int, subprocess.Popen, subprocess.Popen]:
    """Two nodes whose workers wait for the next generation, node 1's two started: (port, node 0, node 1)."""
    port = free_port()
    node0, node1 = start_node(0, port, "wait"), start_node(1, port, "wait")
    seen = read_until(node1, 2)
    assert seen.count("worker rank=") == 2, seen
    return port, node0, node1


def test_a_node_lost_whole_and_started_again_rejoins_with_all_its_ranks_while_the_other_keeps_its_processes():
    port, node0, node1 = two_waiting_nodes()
    os.killpg(node1.pid, signal.SIGKILL)  # the pod gone: its agent and its workers
    node1.wait()
    again = start_node(1, port, "wait")
    codes, out = ended(node0, again)
    assert codes == [0, 0], out
    node0_first = dict(re.findall(r"worker rank=([01]) pid=(\d+) generation=0", out))
    assert dict(re.findall(r"worker rank=(\d) pid=(\d+) rejoined generation=1", out)) == node0_first, out
    assert sorted(re.findall(r"worker rank=([23]) pid=\d+ generation=1", out)) == ["2", "3"], out
    assert "node 1 started again: its ranks join generation 1" in out


def test_node_0_lost_ends_the_other_node_with_138_for_the_job_to_restart_from_the_store():
    _, node0, node1 = two_waiting_nodes()
    os.killpg(node0.pid, signal.SIGKILL)  # node 0's pod gone: the store with it
    node0.wait()
    codes, out = ended(node1)
    assert codes == [138], out


def test_workers_killed_at_once_on_both_nodes_are_replaced_in_one_generation():
    port = free_port()
    node0, node1 = start_node(0, port, "wait"), start_node(1, port, "wait")
    seen = [read_until(node, 2) for node in (node0, node1)]
    pids = {int(r): int(p) for text in seen for r, p in re.findall(r"worker rank=(\d) pid=(\d+) generation=0", text)}
    assert sorted(pids) == [0, 1, 2, 3], seen
    for rank in (1, 3):  # one on each node, together
        os.kill(pids[rank], signal.SIGKILL)
    codes, out = ended(node0, node1)
    assert codes == [0, 0], out
    assert sorted(re.findall(r"worker rank=([13]) pid=\d+ generation=1", out)) == ["1", "3"], out
    assert dict(re.findall(r"worker rank=([02]) pid=(\d+) rejoined generation=1", out)) == {
        "0": str(pids[0]), "2": str(pids[2])}, out
    assert "generation=2" not in out, out  # one generation for both losses
