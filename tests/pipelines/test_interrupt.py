"""Stopping ``relaunch run`` cleanly with Ctrl-C (SIGINT to the ``relaunch run`` process alone, or a
terminal's to its whole foreground group) while the training trains, even as an asynchronous save
starts: the training commits a checkpoint of the step it stopped at, relaunch says so in one line and
exits 143, every time (before, the warm servers died of the SIGTERM meant for the steps, their workers
with them, and the code was 130 or 143 by timing), and no process of the run is left; the console
names only committed checkpoints; the MLflow run is KILLED with the reason until ``--resume`` continues
it at once and ends it FINISHED with the training's own configuration; ``relaunch trainings`` follows each state. Real processes
throughout: the CLI, kfp.local's steps, torchrun agents in their own sessions, workers."""

from __future__ import annotations

import os
import re
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

from relaunch.components.core.contract.exitcodes import ExitCode
from tests.pipelines.interrupting import RUN_TIMEOUT, finish, interrupt, mlflow_run, start, trainings

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3 * RUN_TIMEOUT)]


@dataclass
class Interrupted:
    stopped: tuple[int, str, str]  # code, stdout, stderr of the stopped `relaunch run`
    run_processes: list[psutil.Process]  # every process the run had started
    left: list[str]  # those still alive after it ended
    records: dict[str, Any]  # the training's summary and first attempt record
    after_stop: dict[str, Any]  # `relaunch trainings` and the MLflow run after the stop
    resumed: tuple[int, str, str]  # `relaunch run --resume`
    after_resume: dict[str, Any]
    cwd: Path


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory) -> Interrupted:
    """A training stopped by SIGINT to `relaunch run` alone at the hardest moment, as the asynchronous
    save of step 20 (of 60) starts: the preemption checkpoint waits for it, then commits the step the
    training stopped at. What it printed and left; then `relaunch run --resume` and what that left. One
    run serves every test of the module (a run and its resume take about 35 s)."""
    from relaunch.components.core.store import open_store
    from relaunch.components.core.store.records import attempt_key, read_json, read_summary
    from tests.cli import newest_training

    cwd = tmp_path_factory.mktemp("ctrl-c")
    code, out, err, run_processes, left = interrupt(cwd, lambda pid: os.kill(pid, signal.SIGINT), at_save=20)
    stopped = (code, out, err)
    store = open_store(newest_training(str(cwd / ".relaunch" / "store")))
    records = {"summary": read_summary(store), "attempt": read_json(store, attempt_key(1))}
    after_stop = {"trainings": trainings(cwd), "run": mlflow_run(cwd)}
    resumed = finish(start(cwd, "--resume"), cwd)
    after_resume = {"trainings": trainings(cwd), "run": mlflow_run(cwd)}
    return Interrupted(stopped, run_processes, left, records, after_stop, resumed, after_resume, cwd)


def test_sigint_to_the_cli_alone_leaves_no_process_of_the_run(interrupted):
    # two warm servers, the launch step, two torchrun agents (own sessions) and their two workers
    assert len(interrupted.run_processes) >= 5, interrupted.run_processes
    assert interrupted.left == []


def test_resume_after_sigint_finishes_the_training_at_once(interrupted):
    code, out, err = interrupted.resumed
    assert code == 0, (out[-3000:], err[-3000:])
    assert "resuming the training in" in out and "already committed" not in out + err


def test_the_resumed_training_keeps_its_own_configuration_in_the_summary_and_mlflow(interrupted):
    from relaunch.components.core.store import open_store
    from relaunch.components.core.store.records import read_summary
    from relaunch.components.core.store.training_folders import training_names, training_uri

    root = str(interrupted.cwd / ".relaunch" / "store")
    (name,) = training_names(open_store(root))  # the resume continued it, no second training
    summary = read_summary(open_store(training_uri(root, name)))
    assert (summary["last_step"], summary["total_steps"], summary["exit_code"]) == (60, 60, 0)
    run = interrupted.after_resume["run"]
    assert run.data.params["train.max_steps"] == "60" and run.data.params["train.hidden_size"] == "32"


def test_ctrl_c_at_a_step_whose_checkpoint_commits_exits_143_in_one_line_saying_so_and_how_to_resume(interrupted):
    code, out, err = interrupted.stopped
    summary = interrupted.records["summary"]
    assert summary["exit_code"] == ExitCode.PREEMPTED, summary
    assert summary["last_committed_step"] == summary["last_step"] >= 20, summary  # after the save in flight
    assert code == ExitCode.PREEMPTED, (code, err[-3000:], out[-2000:])
    assert "Traceback" not in err, err[-3000:]
    (line,) = err.strip().splitlines()
    assert line.startswith("relaunch: stopped by Ctrl-C (SIGINT); ") and "--resume" in line
    assert f"checkpoint at step {summary['last_step']} committed" in line


def test_the_console_names_as_saved_only_the_checkpoints_that_committed(interrupted):
    _, out, _ = interrupted.stopped
    records = interrupted.records
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

    after_stop, (code, out, err), after_resume = interrupted.after_stop, interrupted.resumed, interrupted.after_resume
    run = after_stop["run"]
    assert run.info.status == "KILLED", run.info
    assert run.data.tags[END_REASON_TAG].startswith("interrupted: stopped by Ctrl-C (SIGINT)"), run.data.tags
    assert code == 0, (out[-3000:], err[-3000:])
    run = after_resume["run"]
    assert run.info.run_id == after_stop["run"].info.run_id
    assert run.info.status == "FINISHED" and END_REASON_TAG not in run.data.tags, (run.info, run.data.tags)


def test_relaunch_trainings_shows_it_interrupted_at_its_step_then_finished_with_its_registered_version(interrupted):
    records, stopped = interrupted.records, interrupted.after_stop["trainings"]
    after_resume = interrupted.after_resume
    assert stopped["state"] == "interrupted" and stopped["step"] == records["summary"]["last_step"], stopped
    assert f"at step {records['summary']['last_step']}" in stopped["detail"], stopped
    finished = after_resume["trainings"]
    assert finished["state"] == "finished", finished
    assert re.fullmatch(r"\S+ version \d+", finished["registered_version"] or ""), finished


def test_ctrl_c_in_a_terminal_signals_the_whole_foreground_group_and_still_ends_in_one_line(tmp_path):
    """A terminal's Ctrl-C sends SIGINT to the whole foreground process group (here: the group the
    CLI leads), the CLI, its warm servers and the launch step at once; torchrun agents are in their own
    sessions."""
    code, out, err, _, left = interrupt(tmp_path, lambda pid: os.killpg(pid, signal.SIGINT))
    assert code in (ExitCode.INTERRUPTED, ExitCode.PREEMPTED), (out[-2000:], err[-3000:])
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err[-3000:]
    assert left == []
