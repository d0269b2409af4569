"""Uploads a killed writer left are found and aborted (counted on the S3 server by an independent
client), every request of the cleanup is retried, a conditional write whose answer was lost is
still recognised as ours, and the bucket lifecycle rule in manifests/ is one S3 accepts."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from relaunch.components.core.checkpoint import CheckpointManager
from relaunch.components.core.contract.errors import TransientFailure
from relaunch.components.core.store import FileStore, ObjectStore, S3Driver, open_store
from tests.core.faults import ScriptedProxy
from tests.core.helpers import s3_root

ROOT = Path(__file__).resolve().parents[2]
BUCKET = "relaunch-ckpt"

# A writer process: one streamed file per "rank", each past its first part, then it waits to be killed.
_WRITER = r"""
import sys, time
from relaunch.components.core.store import open_store, s3
from relaunch.components.core.store.object_store import PART_SLACK
s3.PART_SIZE = 5 * 1024 * 1024               # S3's smallest part
store = open_store(sys.argv[1])
writers = [store.open_writer(f"checkpoints/step-000000000010/__{rank}_0.distcp") for rank in range(2)]
for w in writers:
    w.write(b"x" * (s3.PART_SIZE + s3.PART_SIZE // PART_SLACK + 1))  # the first part goes up; the rest waits
while store.stats["bytes_written"] < 2 * s3.PART_SIZE:
    time.sleep(0.01)
print("first parts up", flush=True)
time.sleep(600)
"""


def _s3(server):
    import boto3

    return boto3.client("s3", endpoint_url=server.endpoint, region_name="us-east-1",
                        aws_access_key_id=server.env()["AWS_ACCESS_KEY_ID"],
                        aws_secret_access_key=server.env()["AWS_SECRET_ACCESS_KEY"])


def _uploads(client, prefix: str) -> list[dict]:
    """The incomplete multipart uploads under ``prefix``, as the server lists them."""
    return client.list_multipart_uploads(Bucket=BUCKET, Prefix=prefix).get("Uploads", [])


def _prefix(root: str) -> str:
    return root.split(f"s3://{BUCKET}/", 1)[1]


@contextlib.contextmanager
def _proxied_store(monkeypatch, s3_env, root: str, rules, retries: int = 5):
    """An S3 store at ``root`` that talks to the server through a ScriptedProxy (stopped after)."""
    proxy = ScriptedProxy(s3_env.port, rules).start()
    with monkeypatch.context() as patch:
        patch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        store = ObjectStore(S3Driver(BUCKET), _prefix(root), retries=retries, backoff=0.01)
    try:
        yield store, proxy
    finally:
        proxy.stop()


def test_uploads_of_a_writer_killed_after_its_first_part_are_aborted_by_the_next_writer(s3_env, tmp_path):
    root = s3_root(s3_env, "killed")
    prefix = _prefix(root)
    client = _s3(s3_env)
    other = client.create_multipart_upload(Bucket=BUCKET, Key=f"{prefix}-other/checkpoints/x")["UploadId"]
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, root], cwd=ROOT, stdout=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, text=True, start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "first parts up"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    assert proc.returncode == -signal.SIGKILL

    left = _uploads(client, f"{prefix}/checkpoints/")
    assert sorted(u["Key"].rsplit("/", 1)[1] for u in left) == ["__0_0.distcp", "__1_0.distcp"]
    assert all(client.list_parts(Bucket=BUCKET, Key=u["Key"], UploadId=u["UploadId"])["Parts"] for u in left)
    store = open_store(root)
    assert store.list("checkpoints/") == []  # nothing a listing of objects would ever show

    with CheckpointManager(root, owner="the-next-writer", async_save=False) as mgr:
        mgr.take_lease()  # the next writer of this training: it aborts what the killed one left
        assert _uploads(client, f"{prefix}/checkpoints/") == []
        mgr.save(1, {"w": torch.ones(4)})
    assert _uploads(client, f"{prefix}/checkpoints/") == []
    assert store.abort_incomplete_uploads("checkpoints") == 0
    # another store's upload (a prefix that merely starts the same) is not touched
    assert [u["UploadId"] for u in _uploads(client, f"{prefix}-other/")] == [other]
    client.abort_multipart_upload(Bucket=BUCKET, Key=f"{prefix}-other/checkpoints/x", UploadId=other)


def test_a_transient_failure_while_aborting_uploads_is_retried(s3_env, monkeypatch):
    root = s3_root(s3_env, "abort-retry")
    prefix = _prefix(root)
    client = _s3(s3_env)
    for n in range(3):
        client.create_multipart_upload(Bucket=BUCKET, Key=f"{prefix}/checkpoints/step-1/f{n}")
    with _proxied_store(monkeypatch, s3_env, root, [
        ("max-uploads=", "slowdown", 1),  # the listing: 503 SlowDown once
        ("delete ", "reset", 1),          # the first abort: reset before it reaches the server
        ("delete ", "reset_after", 1),    # the second: it lands, its answer is lost
    ]) as (store, proxy):
        assert store.abort_incomplete_uploads("checkpoints/") == 3
    assert (proxy.counts["slowdown"], proxy.counts["reset"], proxy.counts["reset_after"]) == (1, 1, 1)
    assert store.stats["retries"] == 3
    assert _uploads(client, f"{prefix}/") == []


def test_an_abort_that_keeps_failing_is_a_transient_failure_after_bounded_retries(s3_env, monkeypatch):
    root = s3_root(s3_env, "abort-fails")
    prefix = _prefix(root)
    client = _s3(s3_env)
    client.create_multipart_upload(Bucket=BUCKET, Key=f"{prefix}/checkpoints/f")
    with _proxied_store(monkeypatch, s3_env, root, [("delete ", "reset", None)], retries=3) as (store, _):
        with pytest.raises(TransientFailure, match="failed 3 times") as err:
            store.abort_incomplete_uploads("checkpoints")
    assert err.value.exit_code == 138
    assert len(_uploads(client, f"{prefix}/")) == 1
    assert open_store(root).abort_incomplete_uploads("checkpoints") == 1


def test_a_conditional_create_whose_answer_was_lost_still_counts_as_created(s3_env, monkeypatch):
    root = s3_root(s3_env, "cond-create")
    with _proxied_store(monkeypatch, s3_env, root, [("if-none-match", "reset_after", 1)]) as (store, proxy):
        assert store.write_if_absent("LEASE.json", b'{"holder": "me"}') is True
        assert store.write_if_absent("LEASE.json", b'{"holder": "someone else"}') is False
    assert proxy.counts["reset_after"] == 1 and store.stats["conditional_read_back"] == 1
    assert open_store(root).read_bytes("LEASE.json") == b'{"holder": "me"}'


def test_a_conditional_replace_whose_answer_was_lost_still_succeeds(s3_env, monkeypatch):
    root = s3_root(s3_env, "cond-replace")
    with _proxied_store(monkeypatch, s3_env, root, [("if-match", "reset_after", 1)]) as (store, proxy):
        first = store.write_bytes("latest.json", b"10")
        second = store.write_bytes("latest.json", b"20", if_match=first)
        assert second and second == store.etag("latest.json")
    assert proxy.counts["reset_after"] == 1 and store.stats["conditional_read_back"] == 1
    assert open_store(root).read_bytes("latest.json") == b"20"


def test_a_conditional_write_that_raced_another_is_retried_on_409_conflict(s3_env, monkeypatch):
    root = s3_root(s3_env, "cond-conflict")
    with _proxied_store(monkeypatch, s3_env, root, [("if-none-match", "conflict", 1),
                                                    ("if-match", "conflict", 1)]) as (store, proxy):
        assert store.write_if_absent("latest.json", b"10") is True
        store.write_bytes("latest.json", b"20", if_match=store.etag("latest.json"))
    assert proxy.counts["conflict"] == 2 and store.stats["retries"] == 2
    assert open_store(root).read_bytes("latest.json") == b"20"


def test_the_bucket_lifecycle_rule_in_manifests_is_accepted_by_the_s3_api(s3_env):
    client = _s3(s3_env)
    client.create_bucket(Bucket="relaunch-lifecycle")
    config = json.loads((ROOT / "manifests" / "s3" / "lifecycle.json").read_text())
    client.put_bucket_lifecycle_configuration(Bucket="relaunch-lifecycle", LifecycleConfiguration=config)
    (rule,) = client.get_bucket_lifecycle_configuration(Bucket="relaunch-lifecycle")["Rules"]
    assert rule["Status"] == "Enabled"
    assert rule["AbortIncompleteMultipartUpload"]["DaysAfterInitiation"] >= 1


def test_the_filesystem_backend_removes_only_stale_temp_files_under_the_prefix(tmp_path):
    store = FileStore(tmp_path)
    store.write_bytes("checkpoints/step-1/MANIFEST.json", b"{}")
    stale = tmp_path / "checkpoints" / "step-1" / ".MANIFEST.json.0a1b2c.tmp"
    fresh = tmp_path / "checkpoints" / "step-1" / ".latest.json.3d4e5f.tmp"
    outside = tmp_path / "datasets" / ".x.6a7b8c.tmp"
    for path in (stale, fresh, outside):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"partial")
    long_ago = time.time() - 3600
    for path in (stale, outside):
        os.utime(path, (long_ago, long_ago))

    assert store.abort_incomplete_uploads("checkpoints") == 1
    assert not stale.exists() and fresh.exists() and outside.exists()
    assert store.list("checkpoints/") == ["checkpoints/step-1/MANIFEST.json"]
