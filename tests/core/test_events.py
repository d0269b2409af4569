"""The one event schema: every kind goes through the one writer and comes back through the one reader,
on a process's output and in the run's event file; a real training's events reach the console through
the local launcher's reader and the event file, its checkpoints (``saving``) included."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest
from rich.console import Console

from relaunch.components.core.contract import events
from relaunch.components.core.contract.events import Kind
from tests.train.conftest import ROOT, train_config

FIELDS = {Kind.STEP_START: {"step": "prepare", "warm": False},
          Kind.STEP_END: {"step": "launch", "exit_code": 0, "outputs": {"restarts": 1}},
          Kind.ATTEMPT_END: {"step": "launch", "exit_code": 137},
          Kind.RETRY: {"step": "launch", "attempt": 1, "limit": 4, "exit_code": 137, "delay": 10.0},
          Kind.RESUMED: {"attempt": 2, "step": 20, "uri": "/s/checkpoints/step-000000000020", "world_size": 2},
          Kind.FIRST_STEP: {"attempt": 2, "step": 21, "phases": {"imports": 1.5, "first_step": 2.5}},
          Kind.PROGRESS: {"attempt": 1, "step": 5, "total_steps": 40, "loss": 1.25, "epoch": 0},
          Kind.SAVING: {"attempt": 1, "step": 10},
          Kind.SUMMARY: {"exit_code": 0, "reason": "finished", "attempt": 1},
          Kind.EXIT: {"exit_code": 2, "reason": "train.global_batch_size=64 is not divisible"},
          Kind.WAITING: {"line": "waiting for the write lease: store /s is being written by 'run:r1' (host h, "
                                 "pid 7) until 2026-12-04T20:00:00+00:00; it expires in 5s unless renewed, waiting "
                                 "at most 300s more"},
          Kind.TRACKING: {"line": "relaunch: tracking server http://127.0.0.1:5000 back after 12.5s; sending the "
                                  "760 metric points buffered meanwhile"},
          Kind.STORE: {"line": "checkpoint of step 38 not saved: store /s cannot be written (No space left on "
                               "device); step 20, the last committed checkpoint, is intact"}}


def test_every_kind_is_in_the_table():
    assert set(FIELDS) == set(Kind)


@pytest.mark.parametrize("kind", list(Kind), ids=[k.value for k in Kind])
def test_every_kind_round_trips_through_the_one_writer_and_reader_on_a_stream_and_in_a_file(kind, tmp_path):
    out = io.StringIO()
    written = events.write(kind, out, **FIELDS[kind])
    line = out.getvalue()
    assert line.startswith(events.MARKER) and line.endswith("\n") and line.count("\n") == 1
    assert events.read("[default0]:" + line) == written  # behind torchrun's prefix too
    path = tmp_path / "events.jsonl"
    events.write(kind, path, time=written.time, **FIELDS[kind])
    assert json.loads(path.read_text())["kind"] == kind.value  # the file stays one JSON object a line
    assert events.read_file(path) == ([written], path.stat().st_size)


def test_the_writer_follows_relaunch_events_and_writes_nothing_without_it(tmp_path, monkeypatch):
    monkeypatch.delenv(events.EVENTS_ENV, raising=False)
    events.write(Kind.SAVING, step=1, attempt=1)
    path = tmp_path / "events.jsonl"
    monkeypatch.setenv(events.EVENTS_ENV, str(path))
    events.write(Kind.SAVING, step=2, attempt=1)
    assert [e["step"] for e in events.read_file(path)[0]] == [2]


@pytest.mark.parametrize("line", ["relaunch: loss spike at step 3", "{not json", '{"kind": "teleported", "time": 1}',
                                  '{"time": 1}', events.MARKER + "[1, 2]", ""])
def test_a_line_that_is_no_event_reads_as_none(line):
    assert events.read(line) is None


def test_a_half_written_line_is_left_for_the_next_read(tmp_path):
    path = tmp_path / "events.jsonl"
    events.write(Kind.SAVING, path, step=10, attempt=1)
    with open(path, "a") as fh:
        fh.write('{"kind": "saving", "step"')
    found, offset = events.read_file(path)
    assert [e["step"] for e in found] == [10]
    with open(path, "a") as fh:
        fh.write(': 20, "attempt": 1, "time": 1.0}\n')
    assert [e["step"] for e in events.read_file(path, offset)[0]] == [20]


def test_a_real_trainings_events_reach_the_console_through_the_launcher_and_the_event_file(tmp_path):
    """``python -m relaunch.components.train`` (a world of one) prints its events; the local launcher's reader
    passes them on to the event file; the console shows the attempt and every checkpoint it saved."""
    from relaunch.components.launchers.local import ProgressReporter, AgentWatch
    from relaunch.pipelines.local.console import RunView

    config = train_config(tmp_path, f"sqlite:///{tmp_path / 'mlflow.db'}", max_steps=20)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_TRACKING_URI", "RELAUNCH_"))}
    env.update({"PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"})
    done = subprocess.run([sys.executable, "-m", "relaunch.components.train", "--config-json", json.dumps(config)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    path = tmp_path / "events.jsonl"
    path.touch()
    watch = AgentWatch(ProgressReporter(str(path)))
    for line in done.stdout.splitlines():
        watch.handle(line, 0)
    watch.close()
    kinds = [e.kind for e in events.read_file(path)[0]]
    assert kinds[0] == Kind.RESUMED and kinds[-1] == Kind.SUMMARY and Kind.PROGRESS in kinds
    saved = [e["step"] for e in events.read_file(path)[0] if e.kind == Kind.SAVING]
    assert {10, 20} <= set(saved)  # every 10 steps (and at an epoch's end)
    out = io.StringIO()
    view = RunView(Console(file=out, width=200), path, tmp_path / "pipeline.log")
    view.start()
    view.stop()
    text = out.getvalue()
    assert "training attempt 1 started from scratch" in text
    assert f"attempt 1 saved checkpoints at steps {', '.join(map(str, saved))}" in text
    assert [s["step"] for s in view.saved] == saved
