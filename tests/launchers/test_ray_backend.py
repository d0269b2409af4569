"""``launch.backend: ray``: the training on a Ray cluster the launcher starts on this machine (token auth on),
rank actors running relaunch's trainer; a SIGKILLed Ray worker, SIGTERM and a user error against the real thing,
tracked by the session's real MLflow server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch

from relaunch.components.core.checkpoint.layout import MANIFEST
from relaunch.components.core.contract.config import RelaunchConfig
from relaunch.components.core.contract.exitcodes import ExitCode
from relaunch.components.core.store import open_store, records
from relaunch.components.core.store.procfs import boot_ticks, exited, stat_fields
from relaunch.components.launchers import ray as ray_backend
from tests.train.conftest import final_params, metric_steps, mlflow_runs, train_config
from tests.needs import needed

needed("ray", "launch.backend=ray needs the extra: pip install -e '.[ray]' (make test installs it)")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[2]


def ray_config(tmp_path: Path, tracking: str, **train) -> RelaunchConfig:
    config = train_config(tmp_path, tracking, **train)
    config["launch"] = {"backend": "ray", "max_restarts": 2}
    return RelaunchConfig.model_validate(config)


def trainers(marker: str, *, loader_workers: bool = False) -> list[tuple[int, int, int]]:
    """``(pid, parent pid, rank)`` of every running trainer whose command line holds ``marker`` (its store);
    with ``loader_workers``, of the trainers' loader worker processes instead (forked: the same command line)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes()
            if b"relaunch.components.train" not in cmdline or marker.encode() not in cmdline:
                continue
            env = dict(kv.split("=", 1) for kv in (proc / "environ").read_bytes().decode(errors="replace").split("\0") if "=" in kv)
            parent = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        found.append((int(proc.name), parent, int(env.get("RANK", -1))))
    pids = {pid for pid, _, _ in found}
    return [t for t in found if (t[1] in pids) == loader_workers]


def kill_a_ray_worker_at(config: RelaunchConfig, step: int, killed: list[int]) -> threading.Thread:
    """Once the training committed ``step``, SIGKILL the Ray worker process (the actor) that hosts the last rank."""
    def watch() -> None:
        deadline = time.monotonic() + 240
        store = Path(config.store.uri)
        while time.monotonic() < deadline:
            if any(int(p.name.split("-")[-1]) >= step for p in (store / "checkpoints").glob("step-*")
                   if p.name.split("-")[-1].isdigit() and (p / MANIFEST).exists()):  # committed, not begun
                ranks = {rank: parent for _pid, parent, rank in trainers(config.store.uri)}
                if config.launch.world_size - 1 in ranks:
                    os.kill(ranks[config.launch.world_size - 1], signal.SIGKILL)
                    killed.append(ranks[config.launch.world_size - 1])
                    return
            time.sleep(0.05)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


@pytest.fixture(scope="module")
def two_runs(mlflow_server, tmp_path_factory):
    """An uninterrupted Ray-backend training and one whose last rank's Ray worker is SIGKILLed after step 20."""
    tmp = tmp_path_factory.mktemp("ray")
    plain = ray_config(tmp / "plain", mlflow_server.uri)
    killed_config = ray_config(tmp / "killed", mlflow_server.uri, step_sleep_seconds=0.05)
    reference = ray_backend.launch(plain, pipeline_run_id="plain", resume_from=None)
    killed: list[int] = []
    killer = kill_a_ray_worker_at(killed_config, 20, killed)
    restarted = ray_backend.launch(killed_config, pipeline_run_id="killed", resume_from=None)
    killer.join(1)
    return plain, reference, killed_config, restarted, killed, mlflow_server.uri


def test_a_sigkilled_ray_worker_is_replaced_and_the_training_ends_bitwise_equal_to_an_uninterrupted_run(two_runs):
    plain, reference, killed_config, restarted, killed, _ = two_runs
    assert reference.exit_code == 0, reference.message
    assert killed, "the Ray worker of the last rank was never found to kill"
    assert restarted.exit_code == 0 and restarted.restarts == 1, restarted
    assert 20 <= restarted.resumed_from_steps[-1] < 40
    a, b = final_params(plain.store.uri), final_params(killed_config.store.uri)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_restarted_ray_training_is_one_mlflow_run_with_every_step_logged_once(two_runs):
    _, _, killed_config, _, _, tracking = two_runs
    runs = mlflow_runs(tracking, killed_config.tracking.experiment)
    assert [r.info.status for r in runs] == ["FINISHED"]
    assert sorted(metric_steps(tracking, runs[0].info.run_id)) == list(range(1, 41))
    assert runs[0].data.tags["relaunch.restarts"] == "1"


def test_the_local_ray_cluster_uses_token_auth_and_is_gone_after_the_launch(tmp_path):
    with ray_backend.LocalRayCluster(num_cpus=1) as cluster:
        token = Path(cluster.env["RAY_AUTH_TOKEN_PATH"])
        assert cluster.env["RAY_AUTH_MODE"] == "token" and oct(token.stat().st_mode & 0o777) == "0o600"
        bare = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | {"HOME": str(tmp_path)}

        def connects(env: dict[str, str]) -> subprocess.CompletedProcess:
            return subprocess.run(
                [sys.executable, "-c", f"import ray; ray.init(address='{cluster.address}'); print('connected')"],
                env=env, capture_output=True, text=True, timeout=120)

        with_token = connects(bare | cluster.env)
        assert "connected" in with_token.stdout, with_token.stderr[-2000:]
        without = connects(bare | {"RAY_AUTH_MODE": "token"})  # a client without the token is refused
        assert "connected" not in without.stdout, without.stdout + without.stderr[-2000:]
        pid, stopping = cluster.proc.pid, boot_ticks()
    assert cluster.proc.poll() is not None and not token.exists()
    assert not ray_backend.group_members(pid, stopping)  # no member of its group left (a reused number aside)


def test_a_group_s_members_are_the_processes_of_that_group_started_before_the_given_time():
    proc = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        time.sleep(0.05)
        assert ray_backend.group_members(proc.pid, boot_ticks() + 1) == [proc.pid]
        assert ray_backend.group_members(proc.pid, 0) == []  # a group started later is not the one asked for
    finally:
        proc.kill()
        proc.wait()
    assert ray_backend.group_members(proc.pid, boot_ticks() + 1) == []


def test_a_group_member_that_exited_and_waits_to_be_reaped_is_not_counted():
    proc = subprocess.Popen(["sleep", "0.1"], start_new_session=True)
    try:
        deadline = time.monotonic() + 10  # a bound for a hang, not a timed assertion
        while not exited(stat_fields(proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stat_fields(proc.pid)[0] == b"Z"  # ended, not reaped yet: its parent has not waited
        assert ray_backend.group_members(proc.pid, boot_ticks() + 1) == []
    finally:
        proc.wait()


@pytest.mark.ci_extended  # the torchrun path proves both in make test; .ci/run's extended lane
def test_a_user_error_ends_the_ray_training_with_exit_2_without_a_restart(tmp_path, capfd):
    config = ray_config(tmp_path, "file:///" + str(tmp_path / "mlruns"))  # the file store MLflow refuses: bad input
    result = ray_backend.launch(config, pipeline_run_id="bad", resume_from=None)
    out = capfd.readouterr().out
    assert result.exit_code == ExitCode.BAD_INPUT, result.message
    assert "restarting the training" not in out and result.restarts == 0


@pytest.mark.ci_extended  # the torchrun path proves both in make test; .ci/run's extended lane
def test_sigterm_to_the_ray_launch_step_commits_a_checkpoint_and_exits_143(tmp_path, mlflow_server):
    config = ray_config(tmp_path, mlflow_server.uri, max_steps=400, step_sleep_seconds=0.03, checkpoint_every_steps=50,
                        checkpoint_at_epoch_end=False)
    log = (tmp_path / "launch.log").open("w")
    step = subprocess.Popen([sys.executable, "-m", "relaunch.components.launch", "--config-json", config.to_json(),
                             "--input", f"pipeline_run_id=sigterm-{uuid.uuid4().hex[:6]}"],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    store = Path(config.store.uri)
    deadline = time.monotonic() + 180
    while not list((store / "checkpoints").glob("step-*")) and step.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)
    step.send_signal(signal.SIGTERM)
    rc = step.wait(120)
    output = (tmp_path / "launch.log").read_text(errors="replace")
    assert rc == ExitCode.PREEMPTED, output[-3000:]
    record = records.read_exit_record(open_store(config.store.uri))
    summary = records.read_summary(open_store(config.store.uri))
    assert record["exit_code"] == 143, record
    assert summary["last_committed_step"] == summary["last_step"] > 0, json.dumps(summary)[:500]
    assert not trainers(config.store.uri), "a trainer outlived its launch step"
