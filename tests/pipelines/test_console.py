"""What ``relaunch run`` prints is read from the steps' typed outputs: the events a run writes (as
pipelines/kfp_entry.py writes them) become each step's outputs dataclass, and the step lines and the
summary are rendered from those."""

from __future__ import annotations

import dataclasses
import io
import json
import time

from rich.console import Console

from relaunch.components.core.contract.config import RelaunchConfig
from relaunch.components.evaluate import EvaluateOutputs
from relaunch.components.finalize import FinalizeOutputs
from relaunch.components.launch import LaunchOutputs
from relaunch.components.locate import LocateOutputs
from relaunch.components.prepare import PrepareOutputs
from relaunch.components.register import RegisterOutputs
from relaunch.pipelines.local.console import RunView, render_summary
from relaunch.pipelines.local.runner import RunResult

OUTPUTS = {
    "prepare": PrepareOutputs(config_json="{}", run_id="r1", dataset_version="ds-1", dataset_uri="/data/ds-1",
                              experiment_id="7"),
    "locate-latest-checkpoint": LocateOutputs(checkpoint_uri="", step=-1, source="none"),
    "launch": LaunchOutputs(restarts=1, resumed_from_steps="[-1, 30]", train_seconds=1.5,
                            duration_seconds=9.0, ettr=0.4, last_checkpoint_uri="/c/step-40", job_name="j"),
    "evaluate": EvaluateOutputs(metrics_json='{"accuracy": 0.9}', passed=True, checkpoint_uri="/c/step-40", step=40),
    "register": RegisterOutputs(model_name="relaunch-digits", version="2", aliases='["challenger"]',
                                champion_version="1", champion_decision="kept the champion"),
    "finalize": FinalizeOutputs(run_id="r1", status="FINISHED"),
}


def test_the_step_lines_and_the_summary_come_from_each_steps_outputs_dataclass(tmp_path):
    events = tmp_path / "events.jsonl"
    with open(events, "w") as fh:
        for step, outputs in OUTPUTS.items():
            now = time.time()
            fh.write(json.dumps({"kind": "step-start", "time": now, "step": step}) + "\n")
            fh.write(json.dumps({"kind": "step-end", "time": now + 1, "step": step, "exit_code": 0,
                                 "outputs": dataclasses.asdict(outputs)}) + "\n")
    out = io.StringIO()
    console = Console(file=out, width=200)
    view = RunView(console, events, tmp_path / "pipeline.log")
    view.start()
    view.stop()  # reads to the end of the file
    assert {step: rec.outputs for step, rec in view.steps.items()} == OUTPUTS
    config = RelaunchConfig.model_validate({"store": {"uri": str(tmp_path / "store")}})
    render_summary(config, RunResult(exit_code=0, seconds=12.0, steps=view.steps, run_dir=tmp_path), console)
    text = out.getvalue()
    for needle in ("dataset ds-1", "no checkpoint: fresh start", "1 restart(s), ETTR 0.400",
                   "accuracy 0.9000 at step 40, gate passed", "relaunch-digits version 2, aliases challenger",
                   "resumed from step 30", "MLflow run FINISHED",
                   "http://127.0.0.1:5000/#/experiments/7/runs/r1?workflowType=machine_learning"):
        assert needle in text, needle


def test_a_failure_message_with_brackets_is_printed_as_text_and_the_retry_after_it_too(tmp_path):
    """gloo's errors name their source as ``[/path/pair.cc:553]``: rich must not read it as markup (the
    view's thread died on it and the retry line never came)."""
    from relaunch.components.core.contract import events
    from relaunch.components.core.contract.events import Kind

    path = tmp_path / "events.jsonl"
    message = "a peer rank failed: [/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed"
    events.write(Kind.STEP_START, path, step="launch")
    events.write(Kind.STEP_END, path, step="launch", exit_code=138, message=message)
    events.write(Kind.RETRY, path, step="launch", attempt=1, limit=4, exit_code=138, delay=10.0)
    out = io.StringIO()
    view = RunView(Console(file=out, width=300), path, tmp_path / "pipeline.log")
    view.start()
    view.stop()
    assert f"exit 138: {message}" in out.getvalue() and "↻ launch" in out.getvalue()


def test_each_attempts_end_is_shown_with_its_exit_code_and_its_reason_in_words(tmp_path):
    """The README's preempt row promises "SIGTERM: checkpoint, exit 143": the terminal shows it, and a
    killed worker's attempt (137), and an attempt whose rank 0 died without a summary."""
    from relaunch.components.core.contract import events
    from relaunch.components.core.contract.events import Kind
    from relaunch.components.train import PEER_KILLED

    path = tmp_path / "events.jsonl"
    events.write(Kind.STEP_START, path, step="launch")
    events.write(Kind.RESUMED, path, attempt=1, step=-1, uri="", world_size=2)
    events.write(Kind.SAVING, path, attempt=1, step=30)
    events.write(Kind.SUMMARY, path, attempt=1, exit_code=143, last_step=31, last_committed_step=31,
                 reason="preempted by SIGTERM at step 31: checkpoint at step 31 committed")
    events.write(Kind.RESUMED, path, attempt=2, step=31, uri="/c/step-31", world_size=2)
    events.write(Kind.SUMMARY, path, attempt=2, exit_code=137, last_step=40, reason=PEER_KILLED)
    events.write(Kind.RESUMED, path, attempt=3, step=31, uri="/c/step-31", world_size=2)
    events.write(Kind.RESUMED, path, attempt=4, step=31, uri="/c/step-31", world_size=2)  # 3 said nothing
    events.write(Kind.SUMMARY, path, attempt=4, exit_code=0, last_step=76, reason="finished")
    out = io.StringIO()
    view = RunView(Console(file=out, width=300), path, tmp_path / "pipeline.log")
    view.start()
    view.stop()
    lines = out.getvalue().splitlines()
    expected = ["attempt 1 saved checkpoints at step 30",
                "attempt 1: preempted by SIGTERM at step 31: checkpoint at step 31 committed -> exit 143, retrying",
                "attempt 2 resumed from step 31",
                f"attempt 2: {PEER_KILLED} -> exit 137, retrying",
                "attempt 3 resumed from step 31",
                "attempt 3 ended before rank 0 could report it: taken as killed (SIGKILL, OOM) -> exit 137, retrying",
                "attempt 4 resumed from step 31",
                "attempt 4 finished at step 76 -> exit 0"]
    found = [next((i for i, line in enumerate(lines) if want in line), -1) for want in expected]
    assert -1 not in found and found == sorted(found), out.getvalue()


def test_reading_every_steps_outputs_imports_no_torch_into_the_cli():
    """The console builds each step's outputs dataclass from its module: importing those modules must not
    import torch (about a CPU second in every ``relaunch run``, for a line of text)."""
    import subprocess
    import sys

    probe = ("import sys; from relaunch.pipelines.spec import STEP_TABLE; "
             "[step.outputs_class() for step in STEP_TABLE.values()]; "
             "print(sorted(m for m in ('torch', 'mlflow', 'matplotlib') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", done.stdout
