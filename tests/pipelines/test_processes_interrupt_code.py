"""Ctrl-C (SIGINT to the ``relaunch run`` process alone) while the training trains: the training commits
a checkpoint of the step it stopped at, and relaunch says so and exits 143, every time (before, the warm
servers died of the SIGTERM meant for the steps, their workers with them, and the code was 130 or 143 by
timing); the console names only committed checkpoints; the MLflow run is KILLED with the reason until
``--resume`` continues it and ends it FINISHED; ``relaunch trainings`` follows each state."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from relaunch.components.core.contract.exitcodes import ExitCode
from tests.cli import RELAUNCH, kill_agents
from tests.pipelines.test_interrupt import RUN_TIMEOUT, SHORT


pytestmark = [pytest.mark.slow, pytest.mark.timeout(3 * RUN_TIMEOUT)]


def _run(cwd: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([RELAUNCH, "run", *args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def _steps_trained(cwd: Path) -> int:
    """The newest step the run's progress events reached (0 before the first)."""
    newest = 0
    for path in (cwd / ".relaunch" / "runs").rglob("events.jsonl"):
        for line in path.read_text().splitlines():
            event = json.loads(line) if line.strip() else {}
            if event.get("kind") == "progress":
                newest = max(newest, int(event["step"]))
    return newest


def _saving(cwd: Path, step: int) -> bool:
    """Whether the run's event file says a checkpoint of ``step`` is being written."""
    for path in (cwd / ".relaunch" / "runs").rglob("events.jsonl"):
        for line in path.read_text().splitlines():
            event = json.loads(line) if line.strip() else {}
            if event.get("kind") == "saving" and event.get("step") == step:
                return True
    return False


def _finish(proc: subprocess.Popen, cwd: Path) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=RUN_TIMEOUT)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            kill_agents(cwd)
    return proc.returncode, out, err


def _trainings(cwd: Path) -> dict:
    done = subprocess.run([RELAUNCH, "trainings", "--json"], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    (training,) = json.loads(done.stdout)
    return training


def _mlflow_run(cwd: Path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{cwd}/.relaunch/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("relaunch").experiment_id])
    return run


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """A training stopped by SIGINT to `relaunch run` alone after its first committed save (step 10 of
    60), what it printed and left; then `relaunch run --resume` and what that left."""
    cwd = tmp_path_factory.mktemp("ctrl-c")
    proc = _run(cwd, *SHORT)
    deadline = time.monotonic() + RUN_TIMEOUT  # a bound for a hang, not a timed assertion
    while _steps_trained(cwd) < 13:
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"the training never reached step 13: {_finish(proc, cwd)}")
        time.sleep(0.1)
    os.kill(proc.pid, signal.SIGINT)
    stopped = _finish(proc, cwd)
    from relaunch.components.core.store import open_store
    from relaunch.components.core.store.records import read_json, read_summary, attempt_key
    from tests.cli import newest_training

    store = open_store(newest_training(str(cwd / ".relaunch" / "store")))
    records = {"summary": read_summary(store), "attempt": read_json(store, attempt_key(1))}
    after_stop = {"trainings": _trainings(cwd), "run": _mlflow_run(cwd)}
    resumed = _finish(_run(cwd, "--resume"), cwd)
    after_resume = {"trainings": _trainings(cwd), "run": _mlflow_run(cwd)}
    return stopped, records, after_stop, resumed, after_resume


def test_ctrl_c_at_a_step_whose_checkpoint_commits_exits_143_and_says_so(interrupted):
    (code, out, err), records, _, _, _ = interrupted
    summary = records["summary"]
    assert summary["exit_code"] == ExitCode.PREEMPTED and summary["last_committed_step"] == summary["last_step"], summary
    assert code == ExitCode.PREEMPTED, (code, err[-3000:], out[-2000:])
    (line,) = err.strip().splitlines()
    assert line.startswith("relaunch: stopped by Ctrl-C (SIGINT); ")
    assert f"checkpoint at step {summary['last_step']} committed" in line


def test_the_console_names_as_saved_only_the_checkpoints_that_committed(interrupted):
    (_, out, _), records, _, _, _ = interrupted
    committed = {int(step) for step in records["attempt"]["commits"]} | {records["attempt"]["last_committed_step"]}
    lines = [line for line in out.splitlines() if "saved checkpoints at" in line or "started checkpoints at" in line]
    assert lines, out
    for line in lines:
        saved = line.split("saved checkpoints at ", 1)[1].split(";")[0] if "saved checkpoints at" in line else ""
        assert set(map(int, re.findall(r"\d+", saved))) <= committed, (line, committed)
    stopped_at = records["summary"]["last_step"]
    assert any(re.search(rf"saved checkpoints at steps? (\d+, )*{stopped_at}\b", line) for line in lines), out
    assert "-> exit 143, stopped with the run" in out and "retrying" not in out, out


def test_the_interrupted_training_is_killed_in_mlflow_with_its_reason_until_resume_finishes_it(interrupted):
    from relaunch.components.core.tracking.client import END_REASON_TAG

    (_, _, _), records, after_stop, (code, out, err), after_resume = interrupted
    run = after_stop["run"]
    assert run.info.status == "KILLED", run.info
    assert run.data.tags[END_REASON_TAG].startswith("interrupted: stopped by Ctrl-C (SIGINT)"), run.data.tags
    assert code == 0, (out[-3000:], err[-3000:])
    run = after_resume["run"]
    assert run.info.run_id == after_stop["run"].info.run_id
    assert run.info.status == "FINISHED" and END_REASON_TAG not in run.data.tags, (run.info, run.data.tags)


def test_relaunch_trainings_shows_it_interrupted_at_its_step_then_finished_with_its_registered_version(interrupted):
    _, records, after_stop, _, after_resume = interrupted
    stopped = after_stop["trainings"]
    assert stopped["state"] == "interrupted" and stopped["step"] == records["summary"]["last_step"], stopped
    assert f"at step {records['summary']['last_step']}" in stopped["detail"], stopped
    finished = after_resume["trainings"]
    assert finished["state"] == "finished", finished
    assert re.fullmatch(r"\S+ version \d+", finished["registered_version"] or ""), finished


@pytest.mark.parametrize("mode", ["warm", pytest.param("cold", marks=pytest.mark.ci_lane)])  # cold: the warm case in make test
def test_ctrl_c_while_a_save_is_in_flight_still_commits_the_step_it_stopped_at_and_exits_143(tmp_path, mode):
    """The hardest moment: SIGINT as the asynchronous save of step 20 starts; the preemption checkpoint
    waits for it, then commits the step the training stopped at. Cold too (every step a fresh interpreter
    under kfp.local's ``sh``), where relaunch used to wait for the step to finish training before it
    stopped anything."""
    proc = _run(tmp_path, *SHORT, *(["--cold"] if mode == "cold" else []))
    deadline = time.monotonic() + RUN_TIMEOUT  # a bound for a hang, not a timed assertion
    while not _saving(tmp_path, 20):
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"the training never saved step 20: {_finish(proc, tmp_path)}")
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGINT)
    code, out, err = _finish(proc, tmp_path)
    from relaunch.components.core.store import open_store
    from relaunch.components.core.store.records import read_summary
    from tests.cli import newest_training

    summary = read_summary(open_store(newest_training(str(tmp_path / ".relaunch" / "store"))))
    assert summary["last_committed_step"] == summary["last_step"] >= 20, summary
    assert code == ExitCode.PREEMPTED, (code, err[-3000:], out[-2000:])
    assert f"checkpoint at step {summary['last_step']} committed" in err
