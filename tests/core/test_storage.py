"""The Store interface behaves the same on both backends; bad URIs and unreachable or missing
buckets fail the way the exit-code contract says."""

from __future__ import annotations

import os

import pytest

from components.core import storage
from components.core.errors import BadInput, TransientFailure
from components.core.storage import FileStore, PreconditionFailed, open_store
from tests.core.helpers import s3_root


@pytest.fixture(params=["fs", "s3"])
def store(request, tmp_path):
    if request.param == "fs":
        return open_store(str(tmp_path / "root"))
    return open_store(s3_root(request.getfixturevalue("s3_env"), "storage"))


def test_bytes_round_trip_and_a_missing_key_is_file_not_found(store):
    store.write_bytes("a/b.txt", b"hello")
    assert store.read_bytes("a/b.txt") == b"hello"
    assert store.exists("a/b.txt") and not store.exists("a/c.txt")
    with pytest.raises(FileNotFoundError):
        store.read_bytes("a/c.txt")


def test_write_if_absent_creates_once(store):
    assert store.write_if_absent("lock", b"one") is True
    assert store.write_if_absent("lock", b"two") is False
    assert store.read_bytes("lock") == b"one"


def test_a_conditional_replace_fails_when_the_key_changed(store):
    etag = store.write_bytes("p.json", b"1")
    store.write_bytes("p.json", b"2", if_match=etag)
    with pytest.raises(PreconditionFailed):
        store.write_bytes("p.json", b"3", if_match=etag)
    assert store.read_bytes("p.json") == b"2"


def test_listing_is_relative_sorted_and_non_recursive_shows_directories(store):
    for key in ["c/step-2/x", "c/step-10/y", "c/latest.json", "other"]:
        store.write_bytes(key, b".")
    assert store.list("c/") == ["c/latest.json", "c/step-10/y", "c/step-2/x"]
    assert store.list("c/", recursive=False) == ["c/latest.json", "c/step-10/", "c/step-2/"]
    store.delete_many(["c/step-10/y", "c/step-2/x"])
    store.delete("c/latest.json")
    store.delete("c/never-existed")
    assert store.list("c/") == []
    assert store.uri_for("other").endswith("/other")


def test_large_files_upload_in_parallel_parts_and_download_intact(store, tmp_path, monkeypatch):
    monkeypatch.setattr(storage, "MULTIPART_THRESHOLD", 5 * 1024 * 1024)
    monkeypatch.setattr(storage, "PART_SIZE", 5 * 1024 * 1024)
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(11 * 1024 * 1024))
    store.upload_file("big/src.bin", src)
    store.download_file("big/src.bin", tmp_path / "dst.bin")
    assert (tmp_path / "dst.bin").read_bytes() == src.read_bytes()
    if not isinstance(store, FileStore):
        assert store.stats["multipart_part"] == 3


def test_the_filesystem_backend_leaves_no_temp_files_behind(tmp_path):
    store = open_store(f"file://{tmp_path}")
    store.write_bytes("k", b"v")
    store.write_if_absent("k", b"w")
    assert sorted(os.listdir(tmp_path)) == ["k"]


@pytest.mark.parametrize("uri,message", [
    ("", "empty"),
    ("ftp://host/x", "not supported"),
    ("s3://", "no bucket"),
    ("s3://user:secret@bucket/x", "must not carry credentials"),
    ("s3://UPPER_case/x", "invalid"),
    ("s3://bucket/../x", r"'\.\.'"),
    ("file://host/x", "file:///absolute/path"),
])
def test_a_malformed_uri_is_bad_input_naming_the_problem(uri, message):
    with pytest.raises(BadInput, match=message):
        open_store(uri)


def test_a_missing_bucket_is_bad_input(s3_env):
    with pytest.raises(BadInput, match="bucket 'relaunch-no-such-bucket' does not exist"):
        open_store("s3://relaunch-no-such-bucket/x")


def test_an_s3_store_without_an_endpoint_is_bad_input(monkeypatch):
    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "MINIO_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(BadInput, match="AWS_ENDPOINT_URL"):
        open_store("s3://bucket/x")


def test_minio_style_environment_variables_work(s3_env, monkeypatch):
    for name in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    from tests.services import S3_ACCESS_KEY, S3_SECRET_KEY

    monkeypatch.setenv("MINIO_ENDPOINT", f"127.0.0.1:{s3_env.port}")
    monkeypatch.setenv("MINIO_SECURE", "false")
    monkeypatch.setenv("MINIO_ACCESS_KEY", S3_ACCESS_KEY)
    monkeypatch.setenv("MINIO_SECRET_KEY", S3_SECRET_KEY)
    s3_env.create_bucket("relaunch-ckpt")
    store = open_store("s3://relaunch-ckpt/minio-env")
    store.write_bytes("k", b"v")
    assert store.read_bytes("k") == b"v"


def test_an_unreachable_endpoint_is_a_transient_failure_after_bounded_retries(monkeypatch):
    from tests.services import free_port

    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    with pytest.raises(TransientFailure, match="failed 3 times") as err:
        open_store("s3://bucket/x", retries=3, backoff=0.01)
    assert err.value.exit_code == 138
