"""``relaunch run --set store.uri=gs://...`` end to end against the GCS emulator, pointed at it the way
users point the official client at an emulator: ``STORAGE_EMULATOR_HOST`` and nothing else (no AWS or
Google credentials in the environment)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from components.core.contract.config import RelaunchConfig

RELAUNCH = str(Path(sys.executable).parent / "relaunch")
TINY = ["--set", "train.hidden_size=32", "--set", "train.checkpoint_every_steps=10", "--set", "launch.rdzv_port=0"]
CREDENTIALS = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "MINIO_ENDPOINT",
               "GOOGLE_APPLICATION_CREDENTIALS")


def _relaunch_run(cwd: Path, gcs_server, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in CREDENTIALS}
    env["STORAGE_EMULATOR_HOST"] = gcs_server.endpoint
    proc = subprocess.Popen([RELAUNCH, "run", *TINY, *args], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=420)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"relaunch run did not finish in 420 s\n{out[-2000:]}\n{err[-2000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_relaunch_run_trains_and_commits_to_a_gs_store_with_only_storage_emulator_host_set(tmp_path, gcs_server):
    from pipelines.commands.run import trainings

    root = gcs_server.root("e2e")
    out = _relaunch_run(tmp_path, gcs_server, "--set", "train.max_steps=20", "--set", f"store.uri={root}",
                        "--set", "evaluate.gate_min=0.0")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    os.environ["STORAGE_EMULATOR_HOST"] = gcs_server.endpoint
    try:
        names = trainings(RelaunchConfig.model_validate({"store": {"uri": root}}))
        assert names, f"no training under {root}"
        from components.core.checkpoint import CheckpointManager

        with CheckpointManager(f"{root}/trainings/{names[-1]}") as mgr:
            assert mgr.latest().step == 20
    finally:
        os.environ.pop("STORAGE_EMULATOR_HOST", None)
    assert not (tmp_path / ".relaunch/store").exists()


def test_relaunch_run_on_a_missing_bucket_is_one_line_and_exit_2(tmp_path, gcs_server):
    out = _relaunch_run(tmp_path, gcs_server, "--set", "store.uri=gs://relaunch-no-such-bucket/x")
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "bucket 'relaunch-no-such-bucket' does not exist" in lines[0], lines
