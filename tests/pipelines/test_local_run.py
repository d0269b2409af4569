"""The whole pipeline on this machine (``relaunch run``: kfp.local, real torchrun, real MLflow), end to end:
with the embedded defaults and a worker killed mid-training, against real services (an S3 server over
HTTP, an ``mlflow server`` on Postgres), with a whole launch step failing and retried, and with
permanent failures that must stop the pipeline at once."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from components.core.config import RelaunchConfig
from components.core.exitcodes import RETRYABLE

ROOT = Path(__file__).resolve().parents[2]
RELAUNCH = str(Path(sys.executable).parent / "relaunch")
TINY = ["--set", "train.hidden_size=32", "--set", "train.checkpoint_every_steps=10", "--set", "launch.rdzv_port=0"]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def relaunch_run(cwd: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``relaunch run`` as a user types it, in its own process group so a hang takes everything down."""
    proc = subprocess.Popen([RELAUNCH, "run", *TINY, *args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, **(env or {})}, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _kill_agents(cwd)
        out, err = proc.communicate()
        pytest.fail(f"relaunch run did not finish in 240 s; log under {cwd}/.relaunch/runs\n{out[-2000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _kill_agents(cwd: Path) -> None:
    """torchrun agents live in their own sessions: find ours by working directory and stop them."""
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{pid}/cwd") == str(cwd):
                    os.kill(int(pid), signal.SIGKILL)


def events(cwd: Path) -> list[dict]:
    files = sorted((cwd / ".relaunch" / "runs").rglob("events.jsonl"))
    return [json.loads(line) for line in files[-1].read_text().splitlines()]


def summary_of(store_uri: str) -> dict:
    from components.core.goodput import read_summary
    from components.core.storage import open_store

    return read_summary(open_store(store_uri))


# ---------------------------------------------------------------- embedded defaults, a worker killed

@pytest.fixture(scope="module")
def embedded(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("embedded")
    (cwd / "tmp").mkdir()
    out = relaunch_run(cwd, "--set", "train.max_steps=40", "--inject-failure", "kill-worker@step=25",
                       env={"TMPDIR": str(cwd / "tmp")})
    return cwd, out


def test_the_embedded_run_finishes_despite_the_killed_worker(embedded):
    cwd, out = embedded
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]


def test_a_whole_pipeline_run_leaves_no_checkpoint_manager_temp_directory_behind(embedded):
    cwd, _ = embedded
    assert sorted(p.name for p in (cwd / "tmp").glob("relaunch-ckpt-*")) == []


def resumed_step(cwd: Path) -> int:
    """Where the second attempt started: the newest checkpoint committed before the kill at step 25
    (20 normally; 19, the epoch-end one, when the async save of 20 was still in flight)."""
    first, second = summary_of(str(cwd / ".relaunch/store"))["resumed_from_steps"]
    assert first == -1
    return second


def test_the_training_resumed_from_the_last_checkpoint_before_the_kill(embedded):
    cwd, _ = embedded
    step = resumed_step(cwd)
    assert step in (19, 20)
    resumed = [e for e in events(cwd) if e["kind"] == "resumed"]
    assert [e["step"] for e in resumed] == [-1, step]
    assert resumed[-1]["uri"].endswith(f"checkpoints/step-{step:012d}")


def test_the_embedded_run_keeps_its_data_under_dot_relaunch(embedded):
    cwd, _ = embedded
    assert (cwd / ".relaunch/mlflow.db").is_file()
    assert any((cwd / ".relaunch/store/datasets").iterdir())
    assert (cwd / ".relaunch/store/checkpoints/step-000000000040/MANIFEST.json").is_file()
    assert any((cwd / ".relaunch/mlartifacts").rglob("confusion_matrix_test.png"))


def test_one_mlflow_run_holds_every_attempt_and_is_finished(embedded):
    cwd, _ = embedded
    client = MlflowClient(f"sqlite:///{cwd}/.relaunch/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("relaunch").experiment_id])
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert "eval_test_accuracy" in run.data.metrics and run.data.params["launch.nodes"] == "2"


def test_one_model_version_is_registered_as_challenger_and_champion_and_its_checkpoint_pinned(embedded):
    cwd, _ = embedded
    client = MlflowClient(f"sqlite:///{cwd}/.relaunch/mlflow.db")
    versions = client.search_model_versions("name = 'relaunch-digits'")
    assert len(versions) == 1
    assert sorted(client.get_model_version("relaunch-digits", versions[0].version).aliases) == ["challenger", "champion"]
    assert versions[0].tags["relaunch.checkpoint_uri"].endswith("checkpoints/step-000000000040")
    assert list((cwd / ".relaunch/store/checkpoints/pins").iterdir())


def test_the_output_is_a_line_per_step_and_a_summary_with_the_restart(embedded):
    cwd, out = embedded
    text = out.stdout
    for step in ("prepare", "locate-latest-checkpoint", "launch", "evaluate", "register", "finalize"):
        assert f"✓ {step}" in text
    for needle in ("MLflow run", "make ui", "checkpoints", "metrics", "relaunch-digits version 1",
                   "challenger, champion", "ETTR", "torchrun restart(s)", f"resumed from step {resumed_step(cwd)}"):
        assert needle in text, needle
    assert "KFP Executor" not in text  # kfp.local's chatter went to the log file


# ---------------------------------------------------------------- real services

def test_the_pipeline_runs_against_s3_and_an_mlflow_server_on_postgres(tmp_path, s3_env, mlflow_server):
    s3_env.create_bucket("relaunch-e2e")
    out = relaunch_run(tmp_path, "--set", "train.max_steps=20", "--set", "store.uri=s3://relaunch-e2e/run",
                       "--set", f"tracking.uri={mlflow_server.uri}", "--set", "registry.model_name=e2e-digits",
                       "--set", "evaluate.gate_min=0.1")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert summary_of("s3://relaunch-e2e/run")["last_committed_step"] == 20
    client = MlflowClient(mlflow_server.uri)
    (version,) = client.search_model_versions("name = 'e2e-digits'")
    assert version.tags["relaunch.checkpoint_uri"] == "s3://relaunch-e2e/run/checkpoints/step-000000000020"
    assert client.get_run(version.run_id).info.status == "FINISHED"
    assert not (tmp_path / ".relaunch/store").exists() and not (tmp_path / ".relaunch/mlflow.db").exists()


# ---------------------------------------------------------------- a whole launch step retried

def test_a_launch_step_failing_with_a_retryable_code_is_retried_with_backoff_and_resumes(tmp_path):
    # synchronous saves: step 10 is committed before step 11 starts, however loaded the machine is
    out = relaunch_run(tmp_path, "--set", "train.max_steps=30", "--set", "launch.max_restarts=0",
                       "--set", "train.async_save=false", "--inject-failure", "kill-worker@step=15")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    evs = events(tmp_path)
    (retry,) = [e for e in evs if e["kind"] == "retry"]
    # the killed worker's peer reports 138 ("a peer rank failed") or the kill itself shows as 137: both retryable
    assert retry["step"] == "launch" and retry["exit_code"] in RETRYABLE and retry["delay"] == 10
    assert [e["step"] for e in evs if e["kind"] == "step-start"].count("launch") == 2
    assert summary_of(str(tmp_path / ".relaunch/store"))["resumed_from_steps"][-1] == 10
    assert "↻ launch" in out.stdout and "1 launch retry" in out.stdout


# ---------------------------------------------------------------- permanent failures stop at once

def _run_in_process(tmp_path, monkeypatch, **overrides):
    from rich.console import Console

    from pipelines.local_run import run_pipeline

    monkeypatch.chdir(tmp_path)
    config = RelaunchConfig.model_validate(overrides)
    return run_pipeline(config, console=Console(file=io.StringIO()), state_dir=tmp_path / ".relaunch")


def test_a_bad_task_path_is_not_retried_and_stops_the_pipeline_with_exit_2(tmp_path, monkeypatch):
    result = _run_in_process(tmp_path, monkeypatch, train={"task": "no.such.module:make_task"})
    assert result.exit_code == 2 and result.failed_step == "prepare"
    assert "train.task: cannot import module 'no.such.module'" in result.message
    assert result.steps["prepare"].attempts == 1
    assert [s for s, r in result.steps.items() if r.attempts] == ["prepare", "finalize"]


def test_a_foreign_checkpoint_to_resume_from_stops_the_pipeline_at_locate(tmp_path, monkeypatch):
    import torch

    from components.core.checkpoint import CheckpointManager
    from components.core.state import TrainingState
    from components.tasks.base import load_task

    other = RelaunchConfig.model_validate({"train": {"hidden_size": 3}})
    torch.manual_seed(0)
    CheckpointManager(str(tmp_path / "other"), async_save=False).save(
        4, TrainingState(load_task(other.train.task, other).build_model()))
    result = _run_in_process(tmp_path, monkeypatch,
                             train={"resume_from": str(tmp_path / "other/checkpoints/step-000000000004")})
    assert result.exit_code == 2 and result.failed_step == "locate-latest-checkpoint"
    assert "holds another model" in result.message
    assert result.steps["locate-latest-checkpoint"].attempts == 1 and result.steps["launch"].attempts == 0
    client = MlflowClient(f"sqlite:///{tmp_path}/.relaunch/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("relaunch").experiment_id])
    assert run.info.status == "FAILED"  # the exit handler closed the run
