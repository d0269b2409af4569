"""What the console says about checkpoints is what committed: a save that only started is never listed
as saved (the issue's "saved checkpoints at steps 19, 20" named a step whose save had only started), and
a process waiting for a live writer's lease says so on the console as it waits."""

from __future__ import annotations

import io

from rich.console import Console

from relaunch.components.core.contract import events
from relaunch.components.core.contract.events import Kind
from relaunch.pipelines.local.console import RunView


def _shown(path, tmp_path, **kwargs) -> str:
    out = io.StringIO()
    view = RunView(Console(file=out, width=300), path, tmp_path / "pipeline.log", **kwargs)
    view.start()
    view.stop()
    return out.getvalue()


def test_a_save_that_started_but_did_not_commit_before_the_attempt_ended_is_not_listed_as_saved(tmp_path):
    path = tmp_path / "events.jsonl"
    events.write(Kind.RESUMED, path, attempt=1, step=-1, uri="", world_size=2)
    events.write(Kind.SAVING, path, attempt=1, step=19)
    events.write(Kind.SAVING, path, attempt=1, step=20)
    events.write(Kind.SUMMARY, path, attempt=1, exit_code=137, last_step=21, last_committed_step=19, reason="killed")
    text = _shown(path, tmp_path)
    assert "attempt 1 saved checkpoints at step 19; started step 20, not committed" in text, text


def test_the_store_s_record_of_commits_decides_and_a_failed_save_between_two_commits_is_named(tmp_path):
    """A full disk failed the save of step 20 and the training went on (issue 26, bullet 1): the summary's
    last committed step (30) alone would take 20 for committed; the attempt record names the commits."""
    path = tmp_path / "events.jsonl"
    for step in (10, 20, 30):
        events.write(Kind.SAVING, path, attempt=1, step=step)
    events.write(Kind.SUMMARY, path, attempt=1, exit_code=0, last_step=40, last_committed_step=30, reason="finished")
    text = _shown(path, tmp_path, committed_steps=lambda attempt: {10, 30} if attempt == 1 else None)
    assert "attempt 1 saved checkpoints at steps 10, 30; started step 20, not committed" in text, text


def test_saves_of_an_attempt_killed_without_a_word_are_not_claimed_as_committed(tmp_path):
    path = tmp_path / "events.jsonl"
    events.write(Kind.RESUMED, path, attempt=1, step=-1, uri="", world_size=2)
    events.write(Kind.SAVING, path, attempt=1, step=10)
    events.write(Kind.RESUMED, path, attempt=2, step=-1, uri="", world_size=2)  # 1 died saving: no record, no summary
    text = _shown(path, tmp_path)
    assert "attempt 1 started checkpoints at step 10 (not known to have committed)" in text, text
    assert "saved checkpoints" not in text, text


def test_a_wait_for_a_live_writers_lease_is_printed_on_the_console_as_it_waits(tmp_path):
    path = tmp_path / "events.jsonl"
    line = ("waiting for the write lease: store /s is being written by 'run:r1' (host other, pid 7) until "
            "2026-12-04T20:00:00+00:00; it expires in 5s unless renewed, waiting at most 300s more")
    events.write(Kind.WAITING, path, line=line)
    assert line in _shown(path, tmp_path)
