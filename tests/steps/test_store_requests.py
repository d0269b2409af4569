"""On S3 each open of the store used to cost a request (HEAD bucket); a process proves the bucket
once, however often its steps open the store. Counted by the S3 server itself, from its access log."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from relaunch.components.core.contract.config import RelaunchConfig

ROOT = Path(__file__).resolve().parents[2]


def _head_bucket_requests(log: Path, bucket: str) -> int:
    return sum(f"HEAD /{bucket} HTTP" in line for line in log.read_text(errors="replace").splitlines())


def test_a_process_checks_an_s3_bucket_once_however_often_its_steps_open_the_store(s3_env, tmp_path):
    bucket = "relaunch-opened-once"
    s3_env.create_bucket(bucket)
    config = RelaunchConfig.model_validate({"store": {"uri": f"s3://{bucket}/exp"},
                                            "tracking": {"uri": f"sqlite:///{tmp_path}/mlflow.db"}})
    script = ("import sys; from relaunch.components.core.runtime.wiring import wire; wire(); "
              "from relaunch.components.core.contract.config import RelaunchConfig; "
              "from relaunch.components import locate, prepare; from relaunch.components.core.store import open_store; "
              "config = RelaunchConfig.from_json(sys.argv[1]); "
              "prepare.check_inputs(config); locate.run(config); locate.run(config); "
              "open_store(config.store.uri).list('checkpoints/')")
    before = _head_bucket_requests(s3_env.log, bucket)
    subprocess.run([sys.executable, "-c", script, config.to_json()], cwd=ROOT, env=dict(os.environ),
                   check=True, timeout=300)
    assert _head_bucket_requests(s3_env.log, bucket) - before == 1


def test_other_credentials_or_another_bucket_are_checked_again(s3_env, monkeypatch):
    from relaunch.components.core.store import open_store

    bucket = "relaunch-checked-again"
    s3_env.create_bucket(bucket)
    before = _head_bucket_requests(s3_env.log, bucket)
    open_store(f"s3://{bucket}/a")
    open_store(f"s3://{bucket}/b")  # another prefix in the same bucket: proven already
    assert _head_bucket_requests(s3_env.log, bucket) - before == 1
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "another-secret")
    open_store(f"s3://{bucket}/a")
    assert _head_bucket_requests(s3_env.log, bucket) - before == 2
