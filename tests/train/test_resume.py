"""Kills, preemptions and world-size changes of a real 2-process torchrun training (gloo, CPU),
tracked by the session's real MLflow server on Postgres; the SIGTERM during a save reaches it through the
container's supervisor (components/launchers/supervise.py)."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch

from relaunch.components.core.store import records
from relaunch.components.core.contract.classify import torchrun_exit
from relaunch.components.core.contract.exitcodes import ExitCode
from relaunch.components.core.store import open_store
from tests.train.conftest import (SUPERVISE, final_params, metric_steps, mlflow_runs, run_torchrun,
                                  start_torchrun, train_config)

pytestmark = pytest.mark.slow


def test_a_sigkilled_worker_is_restarted_and_ends_bitwise_equal_to_an_uninterrupted_run(tmp_path, tracking):
    plain = train_config(tmp_path / "plain", tracking)
    killed = train_config(tmp_path / "killed", tracking)
    killed["launch"] = {"inject_failure": "kill-worker@step=25"}

    reference = run_torchrun(plain, tmp_path, name="plain")
    restarted = run_torchrun(killed, tmp_path, name="killed", max_restarts=2)

    assert reference.proc.returncode == 0, reference.output()[-3000:]
    assert restarted.proc.returncode == 0, restarted.output()[-3000:]
    summary = restarted.records("SUMMARY")[-1]
    assert summary["attempts"] == 2 and 0 < summary["resumed_from_steps"][1] < 25, summary
    a, b = final_params(plain["store"]["uri"]), final_params(killed["store"]["uri"])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    runs = mlflow_runs(tracking, killed["tracking"]["experiment"])
    assert [r.info.status for r in runs] == ["FINISHED"]
    steps = metric_steps(tracking, runs[0].info.run_id)
    assert sorted(steps) == list(range(1, 41)), "every step logged exactly once"
    assert runs[0].data.tags["relaunch.attempt"] == "2"
    assert 0 < float(runs[0].data.tags["goodput.ettr"]) <= 1 and runs[0].data.tags["relaunch.restarts"] == "1"


# SIGTERM mid-training is also proven in make test by test_supervise's 143 and the pipeline's preempt line
@pytest.mark.parametrize("moment", [pytest.param("training", marks=pytest.mark.ci_lane), "save"])
def test_sigterm_commits_a_checkpoint_exits_143_and_the_rerun_loses_no_committed_step(tmp_path, tracking, moment):
    config = train_config(tmp_path, tracking, max_steps=100, step_sleep_seconds=0.03, checkpoint_every_steps=30,
                          checkpoint_at_epoch_end=False, hidden_size=2048 if moment == "save" else 32)
    # during a save: through the container's supervisor, which passes the SIGTERM on to torchrun and its
    # workers and exits with the contract's code itself
    supervised = moment == "save"
    first = start_torchrun(config, tmp_path, name="first", prefix=SUPERVISE if supervised else None)
    if moment == "save":
        first.wait_for("SAVING", lambda r: r["step"] == 30)
    else:
        first.wait_for("PROGRESS", lambda r: r["step"] >= 40)
    first.signal(signal.SIGTERM)
    rc = first.wait()

    store = open_store(config["store"]["uri"])
    assert torchrun_exit(rc, records.read_exit_record(store), first.started_at) == 143, first.output()[-3000:]
    if supervised:
        assert rc == ExitCode.PREEMPTED and "relaunch supervise: torchrun exit" in first.output(), first.output()[-3000:]
    summary = first.records("SUMMARY")[-1]
    assert summary["exit_code"] == 143 and summary["last_committed_step"] == summary["last_step"] >= 30
    run_id = summary["run_id"]
    assert [r.info.status for r in mlflow_runs(tracking, config["tracking"]["experiment"])] == ["KILLED"]

    second = run_torchrun(config, tmp_path, name="second")
    assert second.proc.returncode == 0, second.output()[-3000:]
    assert second.records("RESUMED")[0]["step"] == summary["last_committed_step"]
    runs = mlflow_runs(tracking, config["tracking"]["experiment"])
    assert [(r.info.run_id, r.info.status) for r in runs] == [(run_id, "FINISHED")]
    assert sorted(metric_steps(tracking, run_id)) == list(range(1, 101))


def _sample_sequence(trace_dir: Path) -> list[list[int]]:
    """Per step, the global batch as the ranks consumed it (rank order); a repeat shows up as extra rows."""
    by_step: dict[int, list[tuple[int, list[int]]]] = {}
    for path in trace_dir.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            r = json.loads(line)
            by_step.setdefault(r["step"], []).append((r["rank"], r["index"]))
    return [[i for _, rows in sorted(by_step[s]) for i in rows] for s in sorted(by_step)]


def test_world_size_2_then_1_then_2_consumes_the_sample_sequence_of_an_uninterrupted_run(tmp_path, tracking):
    steps = 45  # 19 steps per epoch: the changes fall inside epochs 0 and 1
    plain_dir, changed_dir = tmp_path / "trace-plain", tmp_path / "trace-changed"
    plain_dir.mkdir()
    changed_dir.mkdir()
    task = {"task": "tests.train.tasks:tracing_task", "max_steps": steps}
    plain = train_config(tmp_path / "plain", tracking, **task)
    assert run_torchrun(plain, tmp_path, env={"TRACE_DIR": str(plain_dir)}).proc.returncode == 0

    changed = train_config(tmp_path / "changed", tracking, **task)
    for nproc, failure in [(2, "preempt@step=12"), (1, "preempt@step=30"), (2, None)]:
        changed["launch"] = {"inject_failure": failure}
        run = run_torchrun(changed, tmp_path, nproc=nproc, env={"TRACE_DIR": str(changed_dir)})
        assert run.records("SUMMARY")[-1]["exit_code"] == (143 if failure else 0), run.output()[-3000:]

    summary = run.records("SUMMARY")[-1]
    assert summary["resumed_from_steps"] == [-1, 13, 31]  # the flag is honoured after the step it arrived in
    expected = _sample_sequence(plain_dir)
    assert len(expected) == steps and all(len(b) == 64 for b in expected)
    assert _sample_sequence(changed_dir) == expected
