"""The README's language-model lines (section "Your own model and data") run as a user types them, on a
smaller model and fewer steps: the plain run, and the run whose worker is SIGKILLed mid-epoch and replaced in
place from its peers' memory; both register a model that writes text, and the killed run's final checkpoint
is bitwise the plain one's."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from tests.cli import RUN_TIMEOUT, newest_training, relaunch_run
from tests.train.test_streamed_data import _assert_bitwise_equal, _final_state

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2 * RUN_TIMEOUT + 60)]

SMALLER = ["--set", "train.max_steps=40", "--set", "train.checkpoint_every_steps=20",
           "--set", "train.task_options.d_model=32", "--set", "train.task_options.n_heads=2",
           "--set", "train.task_options.seq_len=64", "--set", "train.task_options.max_corpus_bytes=1000000",
           "--set", "data.val_fraction=0.05", "--set", "data.test_fraction=0.05", "--set", "evaluate.gate_min=0.1"]
KILL_AT = 30  # the README's step 120 of 200, at the same place of a 40-step run


def readme_language_model_lines() -> list[list[str]]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"runs\s+both\s+lines\s+on\s+a\s+smaller\s+model:\n\n```\n(.*?)```", text, re.S)
    assert block, "the README lost its language-model lines"
    return [shlex.split(re.match(r'make run ARGS="([^"]*)"', line).group(1))
            for line in block.group(1).splitlines() if line.startswith("make run")]


@pytest.fixture(scope="module")
def language_model(tmp_path_factory):
    plain, killed = readme_language_model_lines()
    assert plain == ["--config", "configs/lm.yaml"]
    assert killed == [*plain, "--inject-failure", "kill-worker@step=120"]
    killed = [*plain, "--inject-failure", f"kill-worker@step={KILL_AT}"]
    runs = {}
    for name, args in (("plain", plain), ("killed", killed)):
        cwd = tmp_path_factory.mktemp(name)
        (cwd / "configs").symlink_to(ROOT / "configs")
        runs[name] = (cwd, relaunch_run(cwd, *args, *SMALLER))
    return runs


def test_the_readme_language_model_line_trains_recovers_and_registers_a_model_that_writes_text(language_model):
    import mlflow

    for name, (cwd, out) in language_model.items():
        assert out.returncode == 0, name + out.stdout[-3000:] + out.stderr[-3000:]
        assert "relaunch-lm version 1" in out.stdout and "perplexity" in out.stdout
    cwd, out = language_model["killed"]
    assert "recovered in place" in out.stdout or "resumed at step" in out.stdout, out.stdout[-3000:]
    from tests.pipelines.test_local_run import in_place_recovery

    recovery = in_place_recovery(cwd)
    assert recovery["lost_at_step"] == KILL_AT and 0 < recovery["resumed_step"] <= KILL_AT
    # bitwise the plain training's final state, tied head and AdamW moments included
    states = {}
    for name, (run_cwd, _) in language_model.items():
        config = {"store": {"uri": newest_training(str(run_cwd / ".relaunch/store"))},
                  "train": {"task": "relaunch.components.tasks.lm:make_task",
                            "task_options": {"d_model": 32, "n_heads": 2, "seq_len": 64, "max_corpus_bytes": 1_000_000}}}
        states[name] = _final_state(config)
    _assert_bitwise_equal(states["plain"], states["killed"])
    # the registered model writes text, from the registry as a user loads it
    mlflow.set_tracking_uri(f"sqlite:///{cwd}/.relaunch/mlflow.db")
    try:
        written = mlflow.pyfunc.load_model("models:/relaunch-lm@champion").predict(["def fibonacci(n):\n"])
        again = mlflow.pyfunc.load_model("models:/relaunch-lm@champion").predict(["def fibonacci(n):\n"])
    finally:
        mlflow.set_tracking_uri(None)  # it exports MLFLOW_TRACKING_URI; later tests must not inherit it
    assert isinstance(written[0], str) and written == again
    run = MlflowClient(f"sqlite:///{cwd}/.relaunch/mlflow.db").search_runs(
        [MlflowClient(f"sqlite:///{cwd}/.relaunch/mlflow.db").get_experiment_by_name("relaunch-lm").experiment_id])[0]
    assert run.info.status == "FINISHED"
    assert {"eval_test_perplexity", "eval_test_token_accuracy"} <= set(run.data.metrics) or any(
        k.endswith("perplexity") for k in run.data.metrics), sorted(run.data.metrics)
    assert torch.isfinite(torch.tensor(run.data.metrics.get("val_loss", 0.0)))
