"""``relaunch run --set store.uri=gs://...`` end to end against fake-gcs-server, pointed at it the way
users point the official client at an emulator: ``STORAGE_EMULATOR_HOST`` and nothing else (no AWS or
Google credentials in the environment); and refused on gcp-storage-emulator, which ignores
conditional writes."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.cli import newest_training, relaunch_run

CREDENTIALS = ("AWS_", "MINIO_", "GOOGLE_APPLICATION_CREDENTIALS")


def _relaunch_run(cwd: Path, server, *args: str) -> subprocess.CompletedProcess:
    return relaunch_run(cwd, *args, env={"STORAGE_EMULATOR_HOST": server.endpoint}, without=CREDENTIALS)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_worker_killed_at_step_25_of_40_on_a_gs_store_restarts_once_resumes_and_commits_step_40(tmp_path,
                                                                                               gcs_server):
    from relaunch.components.core.store import open_store
    from relaunch.components.core.store.records import read_summary

    root = gcs_server.root("e2e")
    out = _relaunch_run(tmp_path, gcs_server, "--set", "train.max_steps=40", "--set", f"store.uri={root}",
                        "--set", "evaluate.gate_min=0.0", "--inject-failure", "kill-worker@step=25",
                        "--set", "train.memory_tier=false")  # a restart reads the store, which is what this tests
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    os.environ["STORAGE_EMULATOR_HOST"] = gcs_server.endpoint
    try:
        from relaunch.components.core.checkpoint import CheckpointManager

        training = newest_training(root)
        first, resumed = read_summary(open_store(training))["resumed_from_steps"]  # two attempts: one restart
        with CheckpointManager(training) as mgr:
            assert mgr.latest().step == 40
    finally:
        os.environ.pop("STORAGE_EMULATOR_HOST", None)
    assert first == -1 and 0 < resumed < 25  # a checkpoint before the kill: 10, 19 (an epoch's end) or 20
    assert not (tmp_path / ".relaunch/store").exists()


def test_relaunch_run_on_a_missing_bucket_is_one_line_and_exit_2(tmp_path, gcs_server):
    out = _relaunch_run(tmp_path, gcs_server, "--set", "store.uri=gs://relaunch-no-such-bucket/x")
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "bucket 'relaunch-no-such-bucket' does not exist" in lines[0], lines


def test_relaunch_run_on_a_gcs_emulator_that_ignores_conditional_writes_is_one_line_and_exit_2(
        tmp_path, ignoring_gcs_server):
    root = ignoring_gcs_server.root("refused")
    out = _relaunch_run(tmp_path, ignoring_gcs_server, "--set", f"store.uri={root}")
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and f"store {root} ignores conditional writes" in lines[0], lines
    assert "fake-gcs-server" in lines[0]
