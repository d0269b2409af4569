"""The study machinery without trainings: real Optuna on a real sqlite file, the metrics-file channel,
the resume identity rules, best-trial selection."""

from __future__ import annotations

import re

import pytest

from relaunch.components.core.contract.config import RelaunchConfig
from relaunch.components.core.contract.config_loading import load_config
from relaunch.components.core.contract.errors import BadInput
from relaunch.components.core.trainer.metrics_file import format_line, parse_line, read_new, write_validation
from relaunch.components.core.tuning.study_folder import COMPLETE, FAILED, PRUNED, TrialRecord
from relaunch.components.core.tuning.study import Study, trial_seed
from relaunch.components.core.tuning.trials import best_trial, study_configuration

SPACE = ["--set", "tune.space.train.lr={type: log_uniform, low: 0.001, high: 0.3}",
         "--set", "tune.space.train.hidden_size={type: int, low: 16, high: 128, step: 16}",
         "--set", "tune.space.train.weight_decay={type: categorical, choices: [0.0, 0.01]}"]


def _config(*overrides: str) -> RelaunchConfig:
    pairs = [o for o in [*SPACE, *overrides] if o != "--set"]
    return load_config(None, pairs)


def _storage(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'optuna.db'}"


def test_a_study_reopened_by_another_process_asks_the_same_parameters_as_an_uninterrupted_one(tmp_path):
    config = _config("tune.study=seeded", "tune.trials=4")
    whole = Study(config, _storage(tmp_path / "a"))
    uninterrupted = [whole.ask(n)[1] for n in range(4)]

    first = Study(config, _storage(tmp_path / "b"))
    asked = [first.ask(n)[1] for n in range(2)]
    again = Study(config, _storage(tmp_path / "b"))  # a new process: a fresh sampler, its RNG state lost
    asked += [again.ask(n)[1] for n in range(2, 4)]

    assert asked == uninterrupted
    assert len({tuple(sorted(p.items())) for p in asked}) == 4  # the seeds differ per trial
    other_seed = Study(_config("tune.study=seeded", "tune.sampler.seed=1"), _storage(tmp_path / "c"))
    assert other_seed.ask(0)[1] != uninterrupted[0]


def test_a_trial_that_resumes_gets_its_own_parameters_in_a_new_optuna_trial_and_the_stale_one_fails(tmp_path):
    config = _config("tune.study=resumes")
    study = Study(config, _storage(tmp_path))
    trial, params = study.ask(0)
    study.report(trial, 10, 0.5)

    reopened = Study(config, _storage(tmp_path))  # the process that ran trial 0 died
    assert reopened.fail_stale([trial.number]) == [trial.number]
    resumed, same = reopened.ask(0, params)

    assert same == params and resumed.number != trial.number
    frozen = {t.number: t for t in reopened.study.get_trials()}
    assert frozen[trial.number].state.name == "FAIL"
    assert frozen[resumed.number].user_attrs["relaunch_trial"] == 0
    assert reopened.ask(1)[0].user_attrs["relaunch_trial"] == 1  # nothing left enqueued for another trial


def test_the_median_pruner_stops_a_trial_worse_than_the_median_and_says_by_how_much(tmp_path):
    config = _config("tune.study=prunes", "tune.pruner.startup_trials=2")
    study = Study(config, _storage(tmp_path))
    for n, value in enumerate((0.4, 0.6)):
        trial, _ = study.ask(n)
        assert study.report(trial, 20, value) is None  # fewer than startup_trials complete
        study.complete(trial.number, value)
    good, _ = study.ask(2)
    assert study.report(good, 20, 0.45) is None
    poor, _ = study.ask(3)
    verdict = study.report(poor, 20, 0.61)

    assert verdict is not None and verdict.step == 20
    assert verdict.describe("val_loss", "minimize") == "val_loss 0.61 > median 0.5"


def test_the_sampler_seed_of_a_trial_depends_on_the_study_seed_and_the_trial_number():
    assert trial_seed(0, 3) == trial_seed(0, 3)
    assert len({trial_seed(s, n) for s in range(3) for n in range(50)}) == 150


def test_the_best_trial_is_the_complete_one_with_the_best_value_and_the_lowest_number_among_equals():
    records = [TrialRecord(0, {}, state=COMPLETE, value=0.5), TrialRecord(1, {}, state=PRUNED, value=0.1),
               TrialRecord(2, {}, state=COMPLETE, value=0.3), TrialRecord(3, {}, state=COMPLETE, value=0.3),
               TrialRecord(4, {}, state=FAILED), None]
    assert best_trial(records, "minimize").number == 2
    assert best_trial(records, "maximize").number == 0
    assert best_trial([TrialRecord(0, {}, state=FAILED), None], "minimize") is None


def test_a_validation_line_is_what_katibs_text_collector_parses_and_reads_back_exactly(tmp_path):
    path = tmp_path / "trial" / "metrics.log"
    write_validation(40, {"val_loss": 0.34120000000000001, "val_accuracy": 0.9133, "val_bad": float("nan")}, str(path))
    write_validation(60, {"val_loss": 1e-05, "val_accuracy": 1.0}, str(path))
    text = path.read_text()
    assert text.splitlines()[0] == "step=40 val_accuracy=0.9133 val_loss=0.3412"
    katib = re.compile(r"([\w|-]+)\s*=\s*([+-]?\d*(\.\d+)?([Ee][+-]?\d+)?)")  # Katib's default TEXT filter
    assert {m[0]: float(m[1]) for m in katib.findall(text.splitlines()[1])} == {"step": 60, "val_loss": 1e-05,
                                                                               "val_accuracy": 1.0}
    with open(path, "a") as fh:
        fh.write("step=80 val_loss=0.2")  # still being written
    found, offset = read_new(path)
    assert found == [(40, {"val_accuracy": 0.9133, "val_loss": 0.3412}), (60, {"val_accuracy": 1.0, "val_loss": 1e-05})]
    with open(path, "a") as fh:
        fh.write("5\n")
    assert read_new(path, offset)[0] == [(80, {"val_loss": 0.25})]
    assert parse_line("no metrics here") is None and format_line(3, {}) == "step=3"


def test_nothing_is_written_when_no_metrics_file_is_named(tmp_path, monkeypatch):
    monkeypatch.delenv("RELAUNCH_METRICS_FILE", raising=False)
    monkeypatch.chdir(tmp_path)
    write_validation(1, {"val_loss": 1.0})
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("override, key", [
    ("tune.space.train.lr={type: uniform, low: 0.01, high: 0.2}", "tune.space"),
    ("tune.objective.metric=val_accuracy", "tune.objective"),
    ("tune.sampler.seed=7", "tune.sampler"),
    ("train.max_steps=99", "train.max_steps"),
])
def test_a_resumed_study_refuses_a_change_of_what_it_is_in_one_line(override, key):
    stored = _config("tune.study=s", "train.max_steps=40")
    asked = _config("tune.study=s", "train.max_steps=40", override)
    with pytest.raises(BadInput) as refused:
        study_configuration(asked, stored.model_dump(mode="json"), "s")
    assert str(refused.value).startswith(f"--resume: {key} is ") and "\n" not in str(refused.value)


def test_a_resumed_study_takes_more_trials_and_its_stored_values_for_the_rest():
    stored = _config("tune.study=s", "train.max_steps=40", "tune.trials=4", "train.checkpoint_every_steps=10")
    asked = load_config(None, ["tune.trials=6", "store.uri=/elsewhere"])
    resumed = study_configuration(asked, stored.model_dump(mode="json"), "s")
    assert resumed.tune.trials == 6 and resumed.train.max_steps == 40 and resumed.train.checkpoint_every_steps == 10
    assert resumed.store.uri == "/elsewhere" and set(resumed.tune.space) == set(stored.tune.space)


def test_a_study_in_postgresql_shared_by_two_openers_asks_what_it_asks_in_sqlite(postgres, tmp_path):
    config = _config("tune.study=shared", "tune.trials=4")
    in_sqlite = Study(config, _storage(tmp_path))
    expected = [in_sqlite.ask(n)[1] for n in range(4)]

    url = postgres.create_database("optuna_shared")
    pods = [Study(config, url), Study(config, url)]  # two run-trial steps of a pipeline, one database
    asked = [pods[n % 2].ask(n) for n in range(4)]
    for trial, _ in asked:
        pods[0].complete(trial.number, 0.1 * trial.number)

    assert [params for _, params in asked] == expected
    reopened = Study(config, url)
    assert sorted(t.user_attrs["relaunch_trial"] for t in reopened.study.get_trials()) == [0, 1, 2, 3]
    assert {t.state.name for t in reopened.study.get_trials()} == {"COMPLETE"}
