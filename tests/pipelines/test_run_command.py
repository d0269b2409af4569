"""``relaunch run``'s choice of training: a new namespace per run, ``--resume`` the newest (without
running a pipeline; the whole thing is in test_local_run.py)."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from relaunch.components.core.store import records
from relaunch.components.core.store import ledger
from relaunch.components.core.contract.config import RelaunchConfig
from relaunch.components.core.contract.config_loading import config_from_cli
from relaunch.components.core.contract.errors import BadInput
from relaunch.components.core.store import open_store
from relaunch.components.core.store.records import write_pipeline_finished
from relaunch.pipelines.commands.run import new_training, resume_training, trainings


def _config(root) -> RelaunchConfig:
    return RelaunchConfig.model_validate({"store": {"uri": str(root)}})


def _summary(store, last_step: int, total: int, code: int = 0) -> None:
    summary = ledger.TrainSummary(exit_code=code, reason="", run_id="run-a", attempt=1, last_step=last_step,
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


def _started(root, *overrides: str) -> str:
    """A new training started by `relaunch run --set ...` (its stored configuration); its name."""
    from relaunch.pipelines.commands.run import remember_config

    config = new_training(config_from_cli(None, None, [f"store.uri={root}", *overrides]))
    remember_config(config)
    return config.store.uri.rsplit("/", 1)[1]


def test_resume_continues_with_the_trainings_own_configuration_not_the_defaults(tmp_path):
    name = _started(tmp_path, "train.epochs=8", "train.hidden_size=32")
    config, done, _ = resume_training(config_from_cli(None, None, [f"store.uri={tmp_path}"]))
    assert done == "" and config.train.epochs == 8 and config.train.hidden_size == 32
    assert config.store.uri == f"{tmp_path}/trainings/{name}"


def test_resume_takes_harmless_keys_from_the_command_line(tmp_path):
    _started(tmp_path, "train.epochs=8")
    config, _, _ = resume_training(config_from_cli(None, None, [f"store.uri={tmp_path}", "train.epochs=8",
                                                                "train.log_every_steps=5", "launch.nodes=3"]))
    assert (config.train.epochs, config.train.log_every_steps, config.launch.nodes) == (8, 5, 3)


@pytest.mark.parametrize("override, key", [("train.epochs=4", "train.epochs"), ("train.max_steps=10", "train.max_steps"),
                                           ("train.task=x.y:z", "train.task"), ("data.split_seed=3", "data.split_seed"),
                                           ("train.hidden_size=64", "train.hidden_size")])
def test_a_resume_that_would_change_what_the_training_is_is_refused_in_one_line(tmp_path, override, key):
    name = _started(tmp_path, "train.epochs=8", "train.hidden_size=32")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with pytest.raises(BadInput) as refused:
        resume_training(config_from_cli(None, None, [f"store.uri={tmp_path}", override]))
    message = str(refused.value)
    assert "\n" not in message and key in message and name in message and "without --resume" in message
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_the_cli_refuses_a_resume_that_changes_the_total_steps_with_exit_2_and_one_line(tmp_path, capsys):
    from relaunch.pipelines.cli import main

    _started(tmp_path, "train.epochs=8", "tracking.uri=sqlite:///" + str(tmp_path / "mlflow.db"))
    code = main(["run", "--resume", "--set", f"store.uri={tmp_path}", "--set", "train.epochs=4",
                 "--set", "tracking.uri=sqlite:///" + str(tmp_path / "mlflow.db")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "train.epochs is 8" in err and "asks for 4" in err
