"""Weights & Biases as a second tracker (components/core/tracking/wandb_tracker.py), in offline mode: what the
tracker wrote is read back from the run's own ``.wandb`` transaction logs (tests/core/wandb_records.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from relaunch.components.core.checkpoint import step_key
from relaunch.components.core.contract.config import RelaunchConfig
from relaunch.components.core.store import open_store
from relaunch.components.core.tracking.trackers import AttemptEnd, AttemptStart, open_trackers
from relaunch.components.core.tracking.wandb_tracker import WandbTracker, record_registered_version, wandb_run_id
from tests.core.wandb_records import read_offline_runs
from tests.needs import needed

needed("wandb", "the W&B tracker's tests need the test extra: pip install -e '.[test]'")


@pytest.fixture
def offline(tmp_path, monkeypatch):
    folder = tmp_path / "wandb-dir"
    folder.mkdir()
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(folder))
    monkeypatch.setenv("WANDB_SILENT", "true")
    return folder


def _config(mode: str = "offline") -> RelaunchConfig:
    return RelaunchConfig.model_validate({"tracking": {"wandb": {"project": "relaunch-test", "mode": mode}}})


def _attempt(config, store, attempt: int, resumed_from: int, steps: range, *, checkpoint: int | None = None,
             finished: bool = False) -> WandbTracker:
    tracker = next(t for t in open_trackers(config, store, run_id="mlflow-run-1", attempt=attempt)
                   if isinstance(t, WandbTracker))
    tracker.start(AttemptStart(attempt=attempt, resumed_from=resumed_from, resumed_uri=None, world_size=2))
    tracker.log_params({"train.lr": 0.05, "world_size": 2, "attempt_seen": attempt})
    for step in steps:
        tracker.log_metrics({"train/loss": 1.0 / step}, step)
        if step == checkpoint:
            tracker.log_metrics({"val/loss": 0.5}, step)  # the same step again, within one attempt
            store.write_bytes(f"{step_key(step)}/MANIFEST.json", b"{}")
            tracker.checkpoint_committed(step, store.uri_for(step_key(step)), step_key(step))
    end = (AttemptEnd(step=steps[-1], exit_code=0, reason="finished", status="FINISHED", report={"ettr": 0.9})
           if finished else AttemptEnd(step=steps[-1], exit_code=137, reason="killed", status=None))
    tracker.end_attempt(end)
    tracker.close(30)
    return tracker


def test_three_attempts_write_one_wandb_run_whose_steps_are_unique_and_increasing(offline, tmp_path):
    config, store = _config(), open_store(str(tmp_path / "store"))
    _attempt(config, store, 1, -1, range(1, 11), checkpoint=5)
    _attempt(config, store, 2, 5, range(6, 16), checkpoint=12)  # steps 6..10 were logged by attempt 1
    last = _attempt(config, store, 3, 12, range(13, 21), finished=True)
    assert last.errors == 0

    run = read_offline_runs(str(offline))
    assert run.files == 3 and set(run.run_ids) == {wandb_run_id("mlflow-run-1", store.uri)}
    assert run.steps == list(range(1, 21)), "one run, every step once, in order"
    assert {row["_step"]: row.get("val/loss") for row in run.history if "val/loss" in row} == {5: 0.5, 12: 0.5}
    assert run.config["train.lr"] == 0.05 and run.config["attempt_seen"] == 3
    assert run.summary["checkpoint.latest"] == store.uri_for(step_key(12))
    assert run.summary["relaunch/attempt"] == 3 and run.summary["goodput/ettr"] == 0.9
    references = [entry.ref for artifact in run.artifacts for entry in artifact.manifest.contents]
    assert any("/checkpoints/step-000000000005/" in ref for ref in references), references
    assert {artifact.type for artifact in run.artifacts} == {"checkpoint"}


KILLED_ATTEMPT = textwrap.dedent("""
    import os, signal, sys
    from relaunch.components.core.contract.config import RelaunchConfig
    from relaunch.components.core.store import open_store
    from relaunch.components.core.tracking.trackers import AttemptStart
    from relaunch.components.core.tracking.wandb_tracker import open_tracker

    store, checkpoint, last = open_store(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    config = RelaunchConfig.model_validate({"tracking": {"wandb": {"project": "relaunch-test", "mode": "offline"}}})
    tracker = open_tracker(config, store, run_id="mlflow-run-1", attempt=1)
    tracker.start(AttemptStart(attempt=1, resumed_from=-1, resumed_uri=None, world_size=2))
    for step in range(1, last + 1):
        tracker.log_metrics({"train/loss": 1.0 / step}, step)
        if step == checkpoint:
            tracker.before_checkpoint(step)
    os.kill(os.getpid(), signal.SIGKILL)  # rank 0 lost: W&B's service stops with it
""")


@pytest.mark.parametrize("checkpoint, killed_at", [(5, 8), (250, 300)], ids=["nothing-written", "one-block-written"])
def test_a_rank_0_killed_before_wandb_wrote_its_points_leaves_no_step_missing_or_twice(
        offline, tmp_path, checkpoint, killed_at, capfd):
    config, store = _config(), open_store(str(tmp_path / "store"))
    killed = subprocess.run([sys.executable, "-c", KILLED_ATTEMPT, store.uri, str(checkpoint), str(killed_at)])
    assert killed.returncode == -9
    first = read_offline_runs(str(offline))
    assert first.steps == list(range(1, len(first.steps) + 1)) and len(first.steps) < killed_at, \
        "W&B wrote part of the attempt, in order, not all of it"

    last = _attempt(config, store, 2, checkpoint, range(checkpoint + 1, killed_at + 10), finished=True)
    assert last.errors == 0
    run = read_offline_runs(str(offline))
    assert run.files == 2 and run.steps == list(range(1, killed_at + 10)), "every step once, in order"
    assert "relaunch/wandb_missing_steps" not in run.summary and "not in the W&B run" not in capfd.readouterr().err


def test_steps_no_pending_record_holds_are_named_in_the_summary_and_on_stderr(offline, tmp_path, capfd):
    config, store = _config(), open_store(str(tmp_path / "store"))
    killed = subprocess.run([sys.executable, "-c", KILLED_ATTEMPT, store.uri, "0", "8"])  # no checkpoint seen
    assert killed.returncode == -9
    _attempt(config, store, 2, 5, range(6, 10), finished=True)
    run = read_offline_runs(str(offline))
    assert run.steps == [6, 7, 8, 9] and run.summary["relaunch/wandb_missing_steps"] == "1..5"
    assert "relaunch: wandb: steps 1..5 are not in the W&B run" in capfd.readouterr().err


def test_the_registered_version_is_recorded_in_the_trainings_run(offline, tmp_path):
    config, store = _config(), open_store(str(tmp_path / "store"))
    _attempt(config, store, 1, -1, range(1, 4), finished=True)
    assert record_registered_version(config, run_id="mlflow-run-1", store_uri=store.uri,
                                     model_name="relaunch-digits", version="7")
    run = read_offline_runs(str(offline))
    assert set(run.run_ids) == {wandb_run_id("mlflow-run-1", store.uri)}
    assert run.summary["registry/version"] == "7" and run.steps == [1, 2, 3]


def test_an_unreachable_wandb_server_leaves_the_tracker_off_and_the_training_going(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_API_KEY", "x" * 86)
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # nothing listens on the discard port
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "5")
    store = open_store(str(tmp_path / "store"))
    tracker = _attempt(_config("online"), store, 1, -1, range(1, 4), checkpoint=2, finished=True)
    assert tracker.run is None
    assert "relaunch: wandb: the run could not be opened, W&B is off for this attempt" in capfd.readouterr().err


def test_without_a_wandb_block_no_wandb_tracker_is_opened_and_disabled_mode_opens_none():
    assert not any(isinstance(t, WandbTracker) for t in open_trackers(RelaunchConfig(), None, run_id="r", attempt=1))
    assert not any(isinstance(t, WandbTracker) for t in open_trackers(_config("disabled"), None, run_id="r", attempt=1))
