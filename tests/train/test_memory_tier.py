"""Recovery from memory through the real entrypoint (the in-place agent, gloo, CPU): a SIGKILLed rank
is replaced while its peers keep their processes, the replacement's state comes from its peer's
replica, nothing is read from the store, and the training ends bitwise equal to an uninterrupted one;
when a rank and the holder of its replica die together, every rank reads the store, still bitwise. Across
two nodes (an agent each, node 0's hosting the store): a rank killed on one node is replaced there while
every other rank keeps its process; a node lost whole and started again gets its ranks' state from the
replicas on the other node; both with nothing read from the store and bitwise equal.

The agents start warm, as ``relaunch run`` starts them: forks of the session's zygote, every worker and
replacement a fork too (a worker's own pid is the one it prints when it restores); the test of a
replacement killed while it starts runs cold, where a replacement takes as long as a fresh interpreter."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest
import torch

from relaunch.components.core.contract import events
from relaunch.components.core.runtime.net import free_port
from tests import warm_processes
from tests.train.conftest import ROOT, final_params, run_torchrun, train_config

pytestmark = pytest.mark.slow

RESTORED = re.compile(r"relaunch: rank (\d+) \(pid (\d+)\) restored step (-?\d+) from (memory|store)(?: \(([^)]*)\))?; "
                      r"(\d+) bytes read from the store")


def config(tmp_path: Path, name: str, parallelism: str, **launch) -> dict:
    # a step takes 50 ms: the save of step 20 commits well before the kill at step 25
    cfg = train_config(tmp_path / name, f"sqlite:///{tmp_path / name}/mlflow.db", parallelism=parallelism,
                       memory_tier=True, step_sleep_seconds=0.05)
    cfg["tracking"]["artifact_location"] = str(tmp_path / name / "artifacts")
    cfg["train"]["process_group_timeout_seconds"] = COLLECTIVE_TIMEOUT
    cfg["launch"] = dict(launch)
    return cfg


COLLECTIVE_TIMEOUT = 60.0


class Agent:
    """A running in-place agent with its workers' combined output in a file; ``node``: ``(rank, nnodes,
    port)`` of one node of several (node 0's agent hosts the store on ``port``)."""

    def __init__(self, cfg: dict, tmp_path: Path, nproc: int, node: tuple[int, int, int] | None = None,
                 cold: bool = False):
        self.log = tmp_path / f"agent-{uuid.uuid4().hex[:6]}.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_TRACKING_URI", "RELAUNCH_"))}
        env.update({"PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"})
        (tmp_path / Path(cfg["store"]["uri"]).parent.name).mkdir(parents=True, exist_ok=True)
        nodes = [f"--nnodes={node[1]}", f"--node-rank={node[0]}", "--master-addr=127.0.0.1", f"--master-port={node[2]}",
                 "--node-address=127.0.0.1"] if node else []
        # warm as relaunch run starts it (the agent and every worker, a replacement too, forks of the session's
        # zygote), unless the test needs a worker that starts as slowly as a fresh interpreter
        warm = [] if cold or warm_processes.cold() else ["--warm"]
        popen = warm_processes.popen if warm else subprocess.Popen
        with self.log.open("w") as out:
            self.proc = popen(
                [sys.executable, "-m", "relaunch.components.launchers.inplace", *warm, f"--nproc-per-node={nproc}",
                 "--max-restarts=2", *nodes, "-m", "relaunch.components.train", "--config-json", json.dumps(cfg)],
                cwd=ROOT, env=env, stdout=out, stderr=out, start_new_session=True)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait(self, timeout: float = 240) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise AssertionError(f"the agent did not end within {timeout}s:\n{self.output()[-4000:]}") from None

    def restores(self) -> list[dict]:
        return [{"rank": int(m[1]), "pid": int(m[2]), "step": int(m[3]), "source": m[4], "detail": m[5] or "",
                 "bytes": int(m[6])} for m in RESTORED.finditer(self.output())]

    def recoveries_in_place(self) -> list[dict]:
        """The ``resumed`` events of recoveries in place (rank 0's), with their ``recovery_seconds``."""
        found = (events.read(line) for line in self.output().splitlines())
        return [e.fields for e in found if e is not None and e.kind == events.Kind.RESUMED and e.get("in_place")]

    def started_pids(self) -> dict[int, int]:
        """The pid of each process of generation 0 that the agent started, from its first line (warm: the
        zygote's clients; killing one kills its fork at once, as the loss of a cold worker)."""
        line = re.search(r"generation 0 workers: (.*)", self.output())
        return {int(r): int(p) for r, p in re.findall(r"rank(\d+)=(\d+)", line[1])} if line else {}

    def kill_together(self, ranks) -> None:
        """SIGKILL the processes the agent started for ``ranks`` at one instant, as a lost node's die: the
        agent is stopped (SIGSTOP) while they die, so that it finds them all dead at once. Two kills in a
        row would leave it a window, milliseconds on a busy machine, in which it sees one death alone."""
        started = self.started_pids()
        agent = psutil.Process(started[ranks[0]]).ppid()  # warm, the agent is a fork: not self.proc
        os.kill(agent, signal.SIGSTOP)
        try:
            for rank in ranks:
                os.kill(started[rank], signal.SIGKILL)
        finally:
            os.kill(agent, signal.SIGCONT)

    def worker_pids(self) -> dict[int, int]:
        """The pid of each rank of generation 0, as the worker itself printed it when it started (warm, the
        agent's own line names the zygote's client it started, not the fork that trains)."""
        pids: dict[int, int] = {}
        for restore in self.restores():
            pids.setdefault(restore["rank"], restore["pid"])
        return pids

    def wait_for_step(self, step: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = (events.read(line) for line in self.output().splitlines())
            steps = [int(e.get("step", 0)) for e in found if e is not None and e.kind == events.Kind.PROGRESS]
            if steps and max(steps) >= step:
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"step {step} not reached:\n{self.output()[-4000:]}")


_REFERENCES: dict[tuple[int, str], dict] = {}


def reference_params(tmp_path_factory, nproc: int, parallelism: str) -> dict:
    """The final parameters of an uninterrupted torchrun training of the same configuration (one per
    world size and parallelism for the module)."""
    key = (nproc, parallelism)
    if key not in _REFERENCES:
        where = tmp_path_factory.mktemp(f"reference-{nproc}-{parallelism}")
        cfg = config(where, "plain", parallelism)
        cfg["train"]["memory_tier"] = False
        (where / "plain").mkdir(exist_ok=True)
        run = run_torchrun(cfg, where, nproc=nproc, name="plain")
        assert run.proc.returncode == 0, run.output()[-3000:]
        _REFERENCES[key] = final_params(cfg["store"]["uri"])
    return _REFERENCES[key]


def assert_bitwise(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), \
        {k: (a[k] - b[k]).abs().max().item() for k in a if not torch.equal(a[k], b[k])}


EXTENDED = pytest.mark.ci_extended  # the same recovery at 4 ranks and FSDP2: .ci/run's extended lane


@pytest.mark.parametrize("nproc,parallelism,every", [(2, "ddp", 1), pytest.param(4, "ddp", 1, marks=EXTENDED),
                                                     pytest.param(2, "fsdp", 1, marks=EXTENDED),
                                                     pytest.param(4, "fsdp", 1, marks=EXTENDED),
                                                     pytest.param(2, "ddp", 0, marks=EXTENDED)])
def test_a_killed_rank_is_replaced_in_place_from_its_peers_replica_and_the_run_ends_bitwise_equal(
        tmp_path, tmp_path_factory, nproc, parallelism, every):
    cfg = config(tmp_path, "killed", parallelism, inject_failure="kill-worker@step=25")  # kills the last rank
    cfg["train"]["memory_snapshot_every_steps"] = every
    # a snapshot of every step: the 25 steps done when the kill came; only the commits: the save of step 20
    resumed = 25 if every == 1 else 20
    agent = Agent(cfg, tmp_path, nproc)
    assert agent.wait() == 0, agent.output()[-4000:]
    first = agent.worker_pids()
    recovery = [r for r in agent.restores() if r["step"] >= 0]
    assert sorted(r["rank"] for r in recovery) == list(range(nproc)), agent.output()[-4000:]
    lost = nproc - 1
    for r in recovery:
        assert r["source"] == "memory" and r["bytes"] == 0 and r["step"] == resumed, r
        if r["rank"] == lost:  # the replacement: a new process, its shard from the holder of its replica
            assert r["pid"] != first[lost] and r["detail"] == "replica on rank 0", r
        else:  # a survivor: the same process, its own snapshot
            assert r["pid"] == first[r["rank"]] and r["detail"] == "own", r
    # no survivor waited out the collective timeout: a peer blocked in the old group's collective (a
    # send to a survivor that already left it) learnt of the loss when the survivors closed the group
    in_place = agent.recoveries_in_place()
    assert in_place and all(e["recovery_seconds"] < COLLECTIVE_TIMEOUT for e in in_place), in_place
    assert_bitwise(final_params(cfg["store"]["uri"]), reference_params(tmp_path_factory, nproc, parallelism))


def test_a_rank_killed_before_any_step_is_held_in_memory_or_committed_restarts_the_group_from_scratch_bitwise(
        tmp_path, tmp_path_factory):
    """Snapshots only with the saves (every=0) and the first save at step 20: a kill at step 5 leaves
    nothing to recover from; the survivor, past the start, ends 138 and the agent starts the group again."""
    cfg = config(tmp_path, "early", "ddp", inject_failure="kill-worker@step=5")
    cfg["train"]["memory_snapshot_every_steps"] = 0
    agent = Agent(cfg, tmp_path, 2)
    assert agent.wait() == 0, agent.output()[-4000:]
    output = agent.output()
    assert "before any step was held in memory by every rank or committed to the store" in output, output[-4000:]
    assert "ended with 138: stopping the group" in output, output[-4000:]
    assert [r["step"] for r in agent.restores()].count(-1) >= 4  # the first start, the replacement's, the restart's
    assert_bitwise(final_params(cfg["store"]["uri"]), reference_params(tmp_path_factory, 2, "ddp"))


@EXTENDED
def test_a_replacement_killed_while_it_starts_is_replaced_in_the_same_round_which_the_survivor_still_waits_in(
        tmp_path, tmp_path_factory):
    cfg = config(tmp_path, "twice", "ddp", inject_failure="kill-worker@step=25")
    cfg["train"]["memory_snapshot_every_steps"] = 1
    agent = Agent(cfg, tmp_path, 2, cold=True)  # a replacement imports torch for a second before it rendezvouses
    deadline = time.monotonic() + 120
    while not (started := re.search(r"replacement pid (\d+)", agent.output())) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert started, agent.output()[-4000:]
    os.kill(int(started[1]), signal.SIGKILL)
    assert agent.wait() == 0, agent.output()[-4000:]
    output = agent.output()
    assert "whose rendezvous still waits for the rank" in output and "generation 2" not in output, output[-4000:]
    survivor, replacement = sorted((r for r in agent.restores() if r["step"] >= 0), key=lambda r: r["rank"])
    assert survivor["pid"] == agent.worker_pids()[0] and survivor["detail"] == "own", survivor
    assert replacement["pid"] not in (int(started[1]), agent.worker_pids()[1]), replacement
    assert all(r["source"] == "memory" and r["bytes"] == 0 and r["step"] == 25 for r in (survivor, replacement))
    assert all(e["recovery_seconds"] < COLLECTIVE_TIMEOUT for e in agent.recoveries_in_place())
    assert_bitwise(final_params(cfg["store"]["uri"]), reference_params(tmp_path_factory, 2, "ddp"))


def test_two_ranks_holding_each_others_replicas_killed_together_fall_back_to_the_store_still_bitwise(
        tmp_path, tmp_path_factory):
    cfg = config(tmp_path, "both", "ddp")
    agent = Agent(cfg, tmp_path, 2)
    agent.wait_for_step(24)
    agent.kill_together([0, 1])
    assert agent.wait() == 0, agent.output()[-4000:]
    recovery = [r for r in agent.restores() if r["step"] >= 0]
    assert sorted(r["rank"] for r in recovery) == [0, 1] and all(r["source"] == "store" and r["bytes"] > 0
                                                                  for r in recovery), agent.output()[-4000:]
    assert "the whole group started again" in agent.output()
    assert_bitwise(final_params(cfg["store"]["uri"]), reference_params(tmp_path_factory, 2, "ddp"))


@EXTENDED
def test_a_rank_lost_with_the_holder_of_its_replica_makes_every_rank_read_the_store_survivors_in_place(
        tmp_path, tmp_path_factory):
    cfg = config(tmp_path, "pair", "ddp")
    agent = Agent(cfg, tmp_path, 4)
    agent.wait_for_step(24)
    first = agent.worker_pids()
    agent.kill_together([1, 2])  # rank 2 holds rank 1's replica
    assert agent.wait() == 0, agent.output()[-4000:]
    recovery = [r for r in agent.restores() if r["step"] >= 0]
    assert sorted(r["rank"] for r in recovery) == [0, 1, 2, 3], agent.output()[-4000:]
    assert all(r["source"] == "store" for r in recovery), recovery
    assert {r["rank"]: r["pid"] for r in recovery if r["rank"] in (0, 3)} == {0: first[0], 3: first[3]}
    assert_bitwise(final_params(cfg["store"]["uri"]), reference_params(tmp_path_factory, 4, "ddp"))


def test_the_pod_entrypoint_supervises_the_in_place_agent_and_recovers_from_memory(tmp_path):
    from relaunch.components.core.contract.config import RelaunchConfig
    from relaunch.components.launchers.inplace import pod_command
    from relaunch.components.launchers.jobs import job_spec

    cfg = config(tmp_path, "pod", "ddp", inject_failure="kill-worker@step=25", procs_per_node=2, nodes=1)
    spec = job_spec(RelaunchConfig.model_validate(cfg))
    (tmp_path / "pod").mkdir()
    log = tmp_path / "pod.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_TRACKING_URI", "RELAUNCH_"))}
    env.update({"PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"})
    command = [sys.executable if word == "python" else word for word in pod_command(spec, "pod-1")]
    with log.open("w") as out:  # what the rendered pod runs, with this interpreter
        proc = subprocess.run(command, cwd=ROOT, env=env, stdout=out, stderr=out, timeout=240)
    output = log.read_text(errors="replace")
    assert proc.returncode == 0, output[-4000:]
    recovery = [m for m in RESTORED.finditer(output) if int(m[3]) >= 0]
    assert len(recovery) == 2 and all(m[4] == "memory" and m[6] == "0" for m in recovery), output[-4000:]
    assert "relaunch supervise: in-place agent exit 0 -> 0" in output
    # the workers are forks of the pod's zygote (the supervisor started it): each one's pid is not the pid of
    # the process the agent started (the zygote's client), the replacement's too
    started = {int(p) for p in re.findall(r"rank\d+=(\d+)", output)} | {
        int(p) for p in re.findall(r"replacement pid (\d+)", output)}
    assert started and not started & {int(m[2]) for m in recovery}, output[-4000:]
    assert "starting the worker cold" not in output


def two_nodes(cfg: dict, tmp_path: Path, nproc: int) -> list[Agent]:
    port = free_port()
    return [Agent(cfg, tmp_path, nproc, node=(node, 2, port)) for node in (0, 1)]


def restores_of(*agents: Agent) -> list[dict]:
    return [r for a in agents for r in a.restores() if r["step"] >= 0]


@pytest.mark.parametrize("parallelism", ["ddp", pytest.param("fsdp", marks=EXTENDED)])
def test_a_rank_killed_on_one_of_two_nodes_is_replaced_there_from_its_replica_on_the_other_node_bitwise(
        tmp_path, tmp_path_factory, parallelism):
    cfg = config(tmp_path, "nodes", parallelism, inject_failure="kill-worker@step=25", nodes=2, procs_per_node=1)
    cfg["train"]["memory_snapshot_every_steps"] = 1  # the 25 steps done when the kill came are all in memory
    nodes = two_nodes(cfg, tmp_path, 1)
    assert [a.wait() for a in nodes] == [0, 0], nodes[0].output()[-3000:] + nodes[1].output()[-3000:]
    first = {**nodes[0].worker_pids(), **nodes[1].worker_pids()}
    recovery = restores_of(*nodes)
    assert sorted(r["rank"] for r in recovery) == [0, 1], nodes[1].output()[-4000:]
    for r in recovery:
        assert r["source"] == "memory" and r["bytes"] == 0 and r["step"] == 25, r
    survivor, replacement = sorted(recovery, key=lambda r: r["rank"])
    assert survivor["pid"] == first[0] and survivor["detail"] == "own"
    assert replacement["pid"] != first[1] and replacement["detail"] == "replica on rank 0"
    assert "rank 1 (pid" in nodes[1].output() and "killed" in nodes[1].output()  # node 1's own agent replaced it
    assert_bitwise(final_params(cfg["store"]["uri"]), reference_params(tmp_path_factory, 2, parallelism))


@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=EXTENDED)])
def test_a_node_lost_whole_and_started_again_restores_its_ranks_from_replicas_on_the_other_node_bitwise(
        tmp_path, tmp_path_factory, nproc):
    cfg = config(tmp_path, "lost", "ddp", nodes=2, procs_per_node=nproc)
    # the tier fed by the saves only (steps 10, 20, 30): the kill after step 24 falls 200 ms after the hand-over
    # of step 20, not inside one (snapshots every step: often inside), where a node lost is rightly served by the store
    cfg["train"]["memory_snapshot_every_steps"] = 0
    port = free_port()
    node0, node1 = (Agent(cfg, tmp_path, nproc, node=(node, 2, port)) for node in (0, 1))
    node0.wait_for_step(24)
    os.killpg(node1.proc.pid, signal.SIGKILL)  # the pod gone: its agent and every worker of it
    node1.proc.wait()
    again = Agent(cfg, tmp_path, nproc, node=(1, 2, port))
    assert [node0.wait(), again.wait()] == [0, 0], node0.output()[-3000:] + again.output()[-3000:]
    recovery = restores_of(node0, again)
    world = 2 * nproc
    assert sorted(r["rank"] for r in recovery) == list(range(world)), node0.output()[-3000:] + again.output()[-3000:]
    first = node0.worker_pids()
    for r in recovery:
        assert r["source"] == "memory" and r["bytes"] == 0, r
        if r["rank"] < nproc:  # node 0's: the same processes, their own snapshots
            assert r["pid"] == first[r["rank"]] and r["detail"] == "own", r
        else:  # node 1's, all new: each from the same local rank on node 0
            assert r["detail"] == f"replica on rank {r['rank'] - nproc}", r
    assert len({r["step"] for r in recovery}) == 1
    assert "node 1 started again" in again.output()
    assert_bitwise(final_params(cfg["store"]["uri"]), reference_params(tmp_path_factory, world, "ddp"))
