"""``relaunch tune`` refuses what it cannot run in one line, exit 2, before it writes anything: the store
folder is not even created."""

from __future__ import annotations

import pytest

from tests.cli import relaunch

CONFIG = "configs/tune.yaml"


@pytest.mark.parametrize("override, says", [
    ("tune.space.train.lrr={type: uniform, low: 0.1, high: 0.2}", "key 'train.lrr' is not a configuration field; did you mean 'train.lr'?"),
    ("tune.space.train.lr={type: uniform, low: 0.3, high: 0.2}", "tune.space.train.lr: low=0.3 must be below high=0.2"),
    ("tune.space.train.lr={type: log_uniform, low: 0, high: 0.2}", "a log scale needs bounds above 0"),
    ("tune.trials=0", "tune.trials: Input should be greater than or equal to 1"),
    ("tune.parallel=9", "parallel=9 exceeds trials=4"),
    ("tune.space.train.hidden_size={type: uniform, low: 1, high: 3}", "cannot take a uniform float"),
    ("tune.space.train.hidden_size={type: int, low: 16, high: 64, step: 2.5}", "an int parameter needs a whole step"),
    ("tune.space.train.hidden_size={type: int, low: 16, high: 64, step: 4, log: true}", "takes no step"),
    ("tune.objective.metric=val_f1", "'val_f1' is not a validation metric of the task (it gives val_accuracy, val_loss)"),
    ("tune.space.train.task_options.dropout={type: uniform, low: 0.0, high: 0.5}",
     "tune.space: train.task_options.dropout: the task relaunch.components.tasks.digits:make_task does not read this option"),
])
def test_a_bad_tune_section_is_refused_in_one_line_and_nothing_is_written(tmp_path, override, says):
    root = tmp_path / "store"
    done = relaunch(tmp_path, "tune", "--config", str(_repo() / CONFIG), "--set", f"store.uri={root}",
                    "--set", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", "--set", override, timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], done.stderr
    assert not root.exists() and not (tmp_path / "mlflow.db").exists() and not (tmp_path / ".relaunch").exists()


@pytest.mark.parametrize("args, says", [
    ((), "tune.space is empty"),
    (("--config", CONFIG, "--study", "Not_Kebab"), "--study: 'Not_Kebab' must be kebab-case"),
    (("--config", CONFIG, "--resume"), "holds no study to resume; `relaunch tune` starts one"),
    (("--config", CONFIG, "--resume", "--study", "absent"), "no study 'absent' in"),
])
def test_a_study_that_cannot_start_is_refused_in_one_line_and_nothing_is_written(tmp_path, args, says):
    root = tmp_path / "store"
    args = tuple(str(_repo() / a) if a == CONFIG else a for a in args)
    done = relaunch(tmp_path, "tune", *args, "--set", f"store.uri={root}",
                    "--set", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], done.stderr
    assert not root.exists() and not (tmp_path / "mlflow.db").exists()


def _repo():
    from pathlib import Path

    return Path(__file__).resolve().parents[2]
