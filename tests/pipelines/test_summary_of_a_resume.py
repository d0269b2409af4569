"""The closing summary of a resume tells what happened: a finish-only resume launched nothing (never
"8.1s training in 0.0s launch"), and an incomplete training is why nothing was registered."""

from __future__ import annotations

import dataclasses
import io
import json
import time

from rich.console import Console

from relaunch.components.core.contract.config import RelaunchConfig
from relaunch.components.evaluate import EvaluateOutputs
from relaunch.components.launch import LaunchOutputs
from relaunch.pipelines.local.console import RunView, render_summary
from relaunch.pipelines.local.runner import RunResult
from tests.pipelines.test_console import OUTPUTS


def _summary(tmp_path, **outputs) -> str:
    events = tmp_path / "events.jsonl"
    with open(events, "w") as fh:
        for step, out in {**OUTPUTS, **outputs}.items():
            if out is None:
                continue
            now = time.time()
            fh.write(json.dumps({"kind": "step-start", "time": now, "step": step}) + "\n")
            fh.write(json.dumps({"kind": "step-end", "time": now + 1, "step": step, "exit_code": 0,
                                 "outputs": dataclasses.asdict(out)}) + "\n")
    text = io.StringIO()
    console = Console(file=text, width=200)
    view = RunView(console, events, tmp_path / "pipeline.log")
    view.start()
    view.stop()
    config = RelaunchConfig.model_validate({"store": {"uri": str(tmp_path / "store")}})
    render_summary(config, RunResult(exit_code=0, seconds=3.0, steps=view.steps, run_dir=tmp_path), console)
    return text.getvalue()


def test_a_finish_only_resume_says_nothing_was_launched(tmp_path):
    finished_earlier = LaunchOutputs(restarts=0, resumed_from_steps="[-1]", train_seconds=8.1, duration_seconds=0.0,
                                     ettr=0.9, last_checkpoint_uri="/c/step-40", job_name="", completed=True)
    text = _summary(tmp_path, launch=finished_earlier)
    assert "in 0.0s launch" not in text and "nothing launched: trained earlier (8.1s of training)" in text


def test_a_training_that_did_not_reach_its_end_is_named_as_why_nothing_was_registered(tmp_path):
    short = LaunchOutputs(restarts=0, resumed_from_steps="[-1]", train_seconds=2.0, duration_seconds=5.0,
                          ettr=0.5, last_checkpoint_uri="/c/step-83", job_name="j", completed=False)
    skipped = EvaluateOutputs(metrics_json="{}", passed=False, checkpoint_uri="", step=-1)
    text = _summary(tmp_path, launch=short, evaluate=skipped, register=None)
    assert "not registered: the training did not reach its end" in text


def test_the_summary_of_a_resumed_training_says_what_its_ettr_counts(tmp_path):
    """After a Ctrl-C and ``--resume`` the row read "8.0s training in 9.8s launch; ETTR 0.331", a ratio of
    neither figure: it is goodput's productive time over the training's wall time since its first attempt."""
    resumed = LaunchOutputs(restarts=1, resumed_from_steps="[-1, 20]", train_seconds=8.0, duration_seconds=9.8,
                            ettr=0.331, last_checkpoint_uri="/c/step-40", job_name="j", completed=True)
    text = _summary(tmp_path, launch=resumed)
    assert ("8.0s training in 9.8s launch; ETTR 0.33 (productive training time / wall time since the "
            "training's first attempt)") in text
    earlier = dataclasses.replace(resumed, duration_seconds=0.0, job_name="")
    (tmp_path / "again").mkdir()
    assert ("trained earlier (8.0s of training); ETTR 0.33 (productive training time / wall time since the "
            "training's first attempt)") in _summary(tmp_path / "again", launch=earlier)
