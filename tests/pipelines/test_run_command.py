"""``relaunch run``'s choice of training: a new namespace per run, ``--resume`` the newest (without
running a pipeline; the whole thing is in test_local_run.py)."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from components.core.store import records
from components.core.tracking import goodput
from components.core.contract.config import RelaunchConfig
from components.core.contract.errors import BadInput
from components.core.store import open_store
from components.core.store.records import write_pipeline_finished
from pipelines.commands.run import new_training, resume_training, trainings


def _config(root) -> RelaunchConfig:
    return RelaunchConfig.model_validate({"store": {"uri": str(root)}})


def _summary(store, last_step: int, total: int, code: int = 0) -> None:
    summary = goodput.TrainSummary(exit_code=code, reason="", run_id="run-a", attempt=1, last_step=last_step,
                                   total_steps=total)
    store.write_bytes(records.SUMMARY_KEY, json.dumps(asdict(summary)).encode())


def test_each_run_gets_a_new_namespace_and_nothing_is_written_before_prepare(tmp_path):
    first = new_training(_config(tmp_path))
    assert first.store.uri.startswith(f"{tmp_path}/trainings/") and not tmp_path.joinpath("trainings").exists()
    open_store(first.store.uri).write_bytes("runs/x", b"1")
    second = new_training(_config(tmp_path))
    assert second.store.uri != first.store.uri and trainings(_config(tmp_path)) == [first.store.uri.rsplit("/", 1)[1]]


def test_resuming_a_store_without_a_training_is_bad_input(tmp_path):
    with pytest.raises(BadInput, match="holds no training to resume"):
        resume_training(_config(tmp_path))


def test_resume_continues_the_newest_unfinished_training_in_its_mlflow_run(tmp_path):
    _summary(open_store(f"{tmp_path}/trainings/20260101-000000"), 76, 76)
    newest = open_store(f"{tmp_path}/trainings/20260102-000000")
    _summary(newest, 30, 76, code=137)
    newest.write_bytes(records.RUN_KEY, json.dumps({"run_id": "run-b"}).encode())
    config, done, _ = resume_training(_config(tmp_path))
    assert done == "" and config.store.uri == newest.uri and config.tracking.run_id == "run-b"


def test_resuming_a_training_whose_pipeline_finished_is_one_line_of_nothing_to_do(tmp_path):
    training = f"{tmp_path}/trainings/20260101-000000"
    _summary(open_store(training), 76, 76)
    write_pipeline_finished(open_store(training), "run-a", "pipeline-1")
    _, done, _ = resume_training(_config(tmp_path))
    assert "already reached its end (step 76 of 76" in done and "\n" not in done


def test_resuming_a_training_that_reached_its_end_but_whose_pipeline_did_not_finish_runs_the_pipeline(tmp_path):
    store = open_store(f"{tmp_path}/trainings/20260101-000000")
    _summary(store, 76, 76)  # trained to its end; evaluate or register failed, so finalize wrote no record
    store.write_bytes(records.RUN_KEY, json.dumps({"run_id": "run-a"}).encode())
    config, done, resuming = resume_training(_config(tmp_path))
    assert done == "" and config.tracking.run_id == "run-a"
    assert "reached its end (step 76 of 76) but its pipeline did not finish" in resuming
