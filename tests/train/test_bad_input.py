"""Bad input ends a training with one clear line and exit code 2, and deletes nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from relaunch.components.core.store import records
from relaunch.components.core.checkpoint import CheckpointManager
from relaunch.components.core.contract.classify import torchrun_exit
from relaunch.components.core.contract.config import RelaunchConfig
from relaunch.components.core.trainer.state import TrainingState
from relaunch.components.core.store import open_store
from relaunch.components.tasks.digits import make_task
from tests.train.conftest import ROOT, run_torchrun, train_config

pytestmark = pytest.mark.slow


def _listing(path) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs)


def _train(config: dict, env: dict) -> subprocess.CompletedProcess:
    child = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_TRACKING_URI")}
    return subprocess.run([sys.executable, "-m", "relaunch.components.train", "--config-json", json.dumps(config)],
                          cwd=ROOT, env={**child, **env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                          timeout=120)


@pytest.fixture(scope="module")
def authenticating_s3():
    """A separate moto S3 server that checks signatures (the session one accepts any key): the first
    3 requests create an IAM user with a key, every later one must be signed with it."""
    import boto3

    from tests.services import S3Server

    old = os.environ.get("INITIAL_NO_AUTH_ACTION_COUNT")
    os.environ["INITIAL_NO_AUTH_ACTION_COUNT"] = "3"
    try:
        server = S3Server().start()
    finally:
        os.environ.pop("INITIAL_NO_AUTH_ACTION_COUNT") if old is None else os.environ.update(
            INITIAL_NO_AUTH_ACTION_COUNT=old)
    iam = boto3.client("iam", endpoint_url=server.endpoint, region_name="us-east-1",
                       aws_access_key_id="bootstrap", aws_secret_access_key="bootstrap")
    iam.create_user(UserName="trainer")
    iam.put_user_policy(UserName="trainer", PolicyName="all", PolicyDocument=json.dumps(
        {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}))
    key = iam.create_access_key(UserName="trainer")["AccessKey"]
    env = {**server.env(), "AWS_ACCESS_KEY_ID": key["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"]}
    from minio import Minio

    Minio(f"127.0.0.1:{server.port}", access_key=key["AccessKeyId"], secret_key=key["SecretAccessKey"],
          secure=False, region="us-east-1").make_bucket("guarded")
    yield env
    server.stop()


CASES = [
    # name, how to break the config, words the one line must contain
    ("unknown task path", lambda c, s3: c["train"].update(task="no.such.module:make_task"), "train.task"),
    ("negative lr", lambda c, s3: c["train"].update(lr=-0.1), "train.lr"),
    ("missing store", lambda c, s3: c["store"].update(uri="s3://no-such-bucket/exp"), "no-such-bucket"),
    ("wrong credentials", lambda c, s3: c["store"].update(uri="s3://guarded/exp"), "AWS_ACCESS_KEY_ID"),
]


@pytest.mark.parametrize("name,breaks,words", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_and_exit_2(tmp_path, tracking, s3_server, authenticating_s3, name, breaks, words):
    config = train_config(tmp_path, tracking)
    breaks(config, None)
    env = s3_server.env()
    if name == "wrong credentials":
        env = {**authenticating_s3, "AWS_SECRET_ACCESS_KEY": "not-the-secret"}
    result = _train(config, env)
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert result.returncode == 2, result.stderr[-3000:]
    assert len(errors) == 1 and words in errors[0], result.stderr[-3000:]
    assert not (tmp_path / "store").exists() or name == "unknown task path"


def test_a_checkpoint_of_another_model_is_refused_with_exit_2_and_left_in_place(tmp_path, tracking):
    config = train_config(tmp_path, tracking)
    other = make_task(RelaunchConfig.model_validate({"train": {"hidden_size": 7}})).build_model()
    with CheckpointManager(config["store"]["uri"]) as manager:
        manager.save(5, TrainingState(other))
    before = _listing(tmp_path / "store")

    run = run_torchrun(config, tmp_path, max_restarts=2)

    store = open_store(config["store"]["uri"])
    assert torchrun_exit(run.proc.returncode, records.read_exit_record(store), run.started_at) == 2, run.output()[-3000:]
    assert "checkpoint of another model" in run.output()
    after = _listing(tmp_path / "store")
    assert [k for k in before if k.startswith("checkpoints/")] == [k for k in after if k.startswith("checkpoints/")]
    assert CheckpointManager(store).verify(5).step == 5
