"""Every ``runs/`` key of the store is spelled once, in components/core/store/records.py."""

from __future__ import annotations

import pathlib
import re

from relaunch.components.core.contract.config import RelaunchConfig
from relaunch.components.core.store import open_store, records

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_no_module_but_records_spells_a_runs_key():
    literal = re.compile(r"""["']runs/""")
    offenders = [str(p.relative_to(ROOT)) for folder in ("components", "pipelines") for p in (ROOT / folder).rglob("*.py")
                 if p.name != "records.py" and any(literal.search(line) and "log-batch" not in line
                                                   for line in p.read_text().splitlines())]
    assert offenders == []


def test_the_first_stored_run_stays_and_a_missing_record_reads_as_none(tmp_path):
    store = open_store(str(tmp_path))
    assert records.stored_run_id(store) is None and records.read_summary(store) is None
    assert records.remember_run(store, "run-a", tracking_uri="http://x", experiment="e") == "run-a"
    assert records.remember_run(store, "run-b", tracking_uri="http://x", experiment="e") == "run-a"
    assert records.stored_run_id(store) == "run-a"


def test_a_finished_pipeline_is_recognised_only_for_its_own_run(tmp_path):
    store = open_store(str(tmp_path))
    assert not records.pipeline_finished(store, None)
    records.write_pipeline_finished(store, "run-a", "pipeline-1")
    assert records.pipeline_finished(store, "run-a") and not records.pipeline_finished(store, "run-b")


def test_pending_metrics_round_trip_and_attempt_keys_sort_in_order(tmp_path):
    store = open_store(str(tmp_path))
    assert records.read_pending_metrics(store) == []
    records.write_pending_metrics(store, 4, [[3, {"train/loss": 1.0}], [4, {"train/loss": 0.5}]])
    assert records.read_pending_metrics(store) == [[3, {"train/loss": 1.0}], [4, {"train/loss": 0.5}]]
    for n in (2, 10, 1):
        records.write_json(store, records.attempt_key(n), {"attempt": n})
    assert [records.read_json(store, k)["attempt"] for k in records.attempt_keys(store)] == [1, 2, 10]


def test_the_first_stored_training_config_stays_and_carries_no_credentials(tmp_path):
    store = open_store(str(tmp_path))
    assert records.read_training_config(store) is None
    first = {"train": {"epochs": 8}, "tracking": {"uri": "http://alice:secret@mlflow:5000"}}
    assert records.write_training_config(store, first)["train"]["epochs"] == 8
    assert records.write_training_config(store, {"train": {"epochs": 4}})["train"]["epochs"] == 8
    stored = store.read_bytes(records.CONFIG_KEY).decode()
    assert "secret" not in stored and "alice" not in stored and "http://mlflow:5000" in stored


def test_identity_changes_name_only_the_keys_asked_for_that_change_what_the_training_is():
    stored = {"train": {"epochs": 8, "lr": 0.05, "log_every_steps": 1}, "launch": {"nodes": 2}}
    assert records.identity_changes(stored, {}) == []
    assert records.identity_changes(stored, {"train": {"epochs": 8, "log_every_steps": 5}, "launch": {"nodes": 3}}) == []
    assert records.identity_changes(stored, {"train": {"epochs": 4, "lr": 0.05}}) == [("train.epochs", 8, 4)]
    assert records.identity_changes(stored, {"train": {"max_steps": None}}) == []
    assert records.identity_changes(stored, {"train": {"max_steps": 10}}) == [("train.max_steps", None, 10)]


def test_a_training_stored_under_the_task_name_before_relaunch_moved_under_relaunch_resumes(tmp_path):
    store = open_store(str(tmp_path))
    records.write_training_config(store, {"train": {"task": "components.tasks.digits:make_task", "seed": 0}})
    records.refuse_another_identity(store, {"train": {"task": "relaunch.components.tasks.digits:make_task"}})
    assert RelaunchConfig.model_validate({"train": {"task": "components.tasks.digits:make_task"}}).train.task == \
        "relaunch.components.tasks.digits:make_task"
    assert records.identity_changes({"train": {"task": "components.tasks.digits:make_task"}},
                                    {"train": {"task": "mine.task:make_task"}}) == \
        [("train.task", "relaunch.components.tasks.digits:make_task", "mine.task:make_task")]
