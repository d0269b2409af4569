"""``relaunch run --set store.uri=gs://...`` end to end against the GCS emulator, pointed at it the way
users point the official client at an emulator: ``STORAGE_EMULATOR_HOST`` and nothing else (no AWS or
Google credentials in the environment)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.cli import newest_training, relaunch_run

CREDENTIALS = ("AWS_", "MINIO_", "GOOGLE_APPLICATION_CREDENTIALS")


def _relaunch_run(cwd: Path, gcs_server, *args: str) -> subprocess.CompletedProcess:
    return relaunch_run(cwd, *args, env={"STORAGE_EMULATOR_HOST": gcs_server.endpoint}, without=CREDENTIALS)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_relaunch_run_trains_and_commits_to_a_gs_store_with_only_storage_emulator_host_set(tmp_path, gcs_server):
    root = gcs_server.root("e2e")
    out = _relaunch_run(tmp_path, gcs_server, "--set", "train.max_steps=20", "--set", f"store.uri={root}",
                        "--set", "evaluate.gate_min=0.0")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    os.environ["STORAGE_EMULATOR_HOST"] = gcs_server.endpoint
    try:
        from components.core.checkpoint import CheckpointManager

        with CheckpointManager(newest_training(root)) as mgr:
            assert mgr.latest().step == 20
    finally:
        os.environ.pop("STORAGE_EMULATOR_HOST", None)
    assert not (tmp_path / ".relaunch/store").exists()


def test_relaunch_run_on_a_missing_bucket_is_one_line_and_exit_2(tmp_path, gcs_server):
    out = _relaunch_run(tmp_path, gcs_server, "--set", "store.uri=gs://relaunch-no-such-bucket/x")
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "bucket 'relaunch-no-such-bucket' does not exist" in lines[0], lines
