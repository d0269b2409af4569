"""A study over the language model (configs/lm-tune.yaml): its learning rate and its width, a task option
the task declares, searched by `relaunch tune` as a user types it; each trial streams the study's dataset
from its own folder and the best one's model is registered through the gate."""

from __future__ import annotations

import pytest

from tests.cli import relaunch
from tests.tune.studies import STUDY_TIMEOUT, REPO, study_record, trial_record

# the ci lane: a study over a task option: test_tune_bad_input and the digits studies (test_study_faults); the LM
# pipeline through prepare, evaluate and register: test_language_model_pipeline
pytestmark = [pytest.mark.slow, pytest.mark.ci_lane, pytest.mark.timeout(STUDY_TIMEOUT)]


def test_a_study_over_the_language_models_learning_rate_and_width_registers_its_best_trial(tmp_path):
    done = relaunch(tmp_path, "tune", "--config", str(REPO / "configs" / "lm-tune.yaml"), "--study", "lm",
                    "--set", "tune.trials=2", "--set", "train.max_steps=20", "--set", "tune.pruner.name=none",
                    "--set", "launch.rdzv_port=0", timeout=STUDY_TIMEOUT)

    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    trials = [trial_record(tmp_path, "lm", n) for n in (0, 1)]
    assert [t["state"] for t in trials] == ["complete", "complete"]
    assert all(t["params"]["train.task_options.d_model"] in (32, 64, 128) for t in trials)
    assert trials[0]["params"] != trials[1]["params"]
    record = study_record(tmp_path, "lm")
    best = min((0, 1), key=lambda n: trials[n]["value"])
    assert (record["state"], record["best_trial"]) == ("finished", best)
    assert record["registered"].startswith("relaunch-lm v")
    # every trial read the one dataset the study prepared, from its own folder
    versions = {p.name for n in (0, 1) for p in (tmp_path / f".relaunch/store/studies/lm/trials/{n}/datasets").iterdir()
                if p.name.startswith("sha256-")}
    assert len(versions) == 1
