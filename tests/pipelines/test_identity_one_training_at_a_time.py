"""One training, one pipeline at a time: two ``relaunch run --resume`` started together run one pipeline
(the other is refused in one line naming the process and host, exit 2, nothing written), and a
pipeline's prepare step refuses, before it writes anything, a store whose training another pipeline
is writing or whose stored configuration is another training's (a cluster pipeline uses
``store.uri`` itself, where nothing else compares them)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.cli import RELAUNCH, RUN_TIMEOUT, TINY, kill_agents

ROOT = Path(__file__).resolve().parents[2]


def _overrides(tmp_path: Path) -> list[str]:
    return [f"store.uri={tmp_path}/store", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
            f"tracking.artifact_location={tmp_path}/mlartifacts", "train.max_steps=20",
            "train.step_sleep_seconds=0.25"]  # a window of seconds in which the other one starts


def _sets(overrides: list[str]) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


def _a_training_that_never_ran(tmp_path: Path) -> str:
    """A training ``relaunch run`` started and that stopped before its pipeline opened anything (its
    configuration stored, nothing else): ``--resume`` runs its whole pipeline. Its store URI."""
    from relaunch.components.core.contract.config_loading import config_from_cli
    from relaunch.pipelines.commands.run import new_training, remember_config

    tiny = [TINY[i + 1] for i in range(0, len(TINY), 2)]
    config = new_training(config_from_cli(None, None, [*tiny, *_overrides(tmp_path)]))
    remember_config(config)
    return config.store.uri


def _start(cwd: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([RELAUNCH, "run", *TINY, *args], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _wait(proc: subprocess.Popen, cwd: Path) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        kill_agents(cwd)
        out, err = proc.communicate()
        pytest.fail(f"relaunch run did not finish in {RUN_TIMEOUT} s\n{out[-2000:]}\n{err[-2000:]}")


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT + 120)
def test_two_resumes_at_once_run_one_pipeline_and_the_other_is_refused_naming_its_pid_and_host(tmp_path):
    training = _a_training_that_never_ran(tmp_path)
    args = ["--resume", *_sets(_overrides(tmp_path))]
    first, second = _start(tmp_path, *args), _start(tmp_path, *args)
    (out1, err1), (out2, err2) = _wait(first, tmp_path), _wait(second, tmp_path)
    runs = {first.pid: (first.returncode, out1, err1), second.pid: (second.returncode, out2, err2)}
    refused = [pid for pid, (code, _, _) in runs.items() if code == 2]
    assert len(refused) == 1, {pid: (code, out[-1500:], err[-1500:]) for pid, (code, out, err) in runs.items()}
    winner = next(pid for pid in runs if pid not in refused)
    code, out, err = runs[winner]
    assert code == 0, out[-3000:] + err[-3000:]
    _, refused_out, refused_err = runs[refused[0]]
    line = refused_err.strip()
    assert len(line.splitlines()) == 1, refused_err
    assert f"pid {winner} on host {socket.gethostname()}" in line and "one pipeline of a training" in line, line
    assert "resuming" not in refused_out  # refused before it said what it would do
    runs_of = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").search_runs(
        [e.experiment_id for e in MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").search_experiments()])
    assert len(runs_of) == 1, [r.info.run_id for r in runs_of]
    assert runs_of[0].info.status == "FINISHED"
    from relaunch.components.core.store import open_store
    from relaunch.components.core.store.records import PIPELINE_LOCK_KEY

    assert not open_store(training).exists(PIPELINE_LOCK_KEY)  # released by the winner at its end


def _prepare(config_yaml: Path, *inputs: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "relaunch.components.prepare", "--config", str(config_yaml),
                           *[a for i in inputs for a in ("--input", i)]], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})})


def _cluster_config(tmp_path: Path, **train) -> Path:
    import yaml

    path = tmp_path / f"config-{len(list(tmp_path.glob('config-*')))}.yaml"
    path.write_text(yaml.safe_dump({
        "store": {"uri": str(tmp_path / "store")},
        "tracking": {"uri": f"sqlite:///{tmp_path}/mlflow.db", "artifact_location": str(tmp_path / "mlartifacts")},
        "train": {"hidden_size": 32, **train}}))
    return path


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_prepare_on_a_store_whose_stored_configuration_is_another_training_exits_2_naming_the_keys(tmp_path):
    first = _prepare(_cluster_config(tmp_path, epochs=2), "pipeline_run_id=pipeline-a")
    assert first.returncode == 0, first.stderr[-3000:]
    stored = json.loads((tmp_path / "store/runs/config.json").read_text())
    assert stored["train"]["epochs"] == 2  # prepare stores what it trains, as `relaunch run` does
    before = _tree(tmp_path / "store")
    again = _prepare(_cluster_config(tmp_path, epochs=5, seed=7), "pipeline_run_id=pipeline-b")
    assert again.returncode == 2, again.stderr[-3000:]
    line = again.stderr.strip().splitlines()[-1]
    assert "train.epochs is 2" in line and "has 5" in line and "train.seed" in line, line
    assert "point store.uri at a new folder" in line, line
    assert _tree(tmp_path / "store") == before
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    assert len(client.search_runs([e.experiment_id for e in client.search_experiments()])) == 1
    same = _prepare(_cluster_config(tmp_path, epochs=2, log_every_steps=3), "pipeline_run_id=pipeline-a")
    assert same.returncode == 0, same.stderr[-3000:]  # what may change between attempts does


def test_prepare_on_a_store_another_pipelines_live_writer_holds_exits_2_naming_it_and_writes_nothing(tmp_path):
    writer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        lease = tmp_path / "store/checkpoints/LEASE.json"
        lease.parent.mkdir(parents=True)
        lease.write_text(json.dumps({"owner": "pipeline-a", "token": "t", "host": socket.gethostname(),
                                     "pid": writer.pid, "pid_namespace": str(os.stat("/proc/self/ns/pid").st_ino), "elastic_run_id": "",
                                     "restart_count": 0, "acquired_at": "", "expires_at": time.time() + 3600}))
        before = _tree(tmp_path / "store")
        refused = _prepare(_cluster_config(tmp_path), "pipeline_run_id=pipeline-b")
        assert refused.returncode == 2, refused.stderr[-3000:]
        line = refused.stderr.strip().splitlines()[-1]
        assert "'pipeline-a'" in line and f"pid {writer.pid}" in line and socket.gethostname() in line, line
        assert _tree(tmp_path / "store") == before
        assert not (tmp_path / "mlflow.db").exists() or not MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").search_runs(
            [e.experiment_id for e in MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").search_experiments()])
        retry = _prepare(_cluster_config(tmp_path), "pipeline_run_id=pipeline-a")
        assert retry.returncode == 0, retry.stderr[-3000:]  # a retry of the writer's own pipeline goes on
    finally:
        writer.kill()
        writer.wait()
