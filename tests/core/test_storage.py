"""The Store interface behaves the same on both backends; bad URIs and unreachable or missing
buckets fail the way the exit-code contract says."""

from __future__ import annotations

import inspect
import os
import stat

import pytest

from relaunch.components.core.store import s3 as s3_backend
from relaunch.components.core.contract.errors import BadInput, TransientFailure
from relaunch.components.core.store import FileStore, PreconditionFailed, open_store
from relaunch.components.core.store.s3 import _MinioCalls
from tests.core.helpers import s3_root


@pytest.fixture(params=["fs", "s3", "azure"])
def store(request, tmp_path, monkeypatch):
    if request.param == "fs":
        return open_store(str(tmp_path / "root"))
    if request.param == "azure":
        from relaunch.components.core.store import azure as azure_backend

        monkeypatch.setattr(azure_backend, "BLOCK_SIZE", 5 * 1024 * 1024)  # as the S3 tests set PART_SIZE
        return open_store(request.getfixturevalue("azure_env").root("storage"))
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


def test_a_conditional_replace_of_a_key_deleted_since_it_was_read_fails(store):
    etag = store.write_bytes("p.json", b"1")
    store.delete("p.json")
    with pytest.raises(PreconditionFailed):
        store.write_bytes("p.json", b"2", if_match=etag)
    assert not store.exists("p.json")


def test_no_upload_is_left_to_abort_after_complete_and_aborted_writes(store, monkeypatch):
    monkeypatch.setattr(s3_backend, "PART_SIZE", 5 * 1024 * 1024)
    done = store.open_writer("c/done.bin")
    done.write(os.urandom(11 * 1024 * 1024))
    done.close()
    dropped = store.open_writer("c/dropped.bin")
    dropped.write(os.urandom(6 * 1024 * 1024))
    dropped.abort()
    assert store.abort_incomplete_uploads("c") == 0
    assert store.list("c/") == ["c/done.bin"]


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
    monkeypatch.setattr(s3_backend, "MULTIPART_THRESHOLD", 5 * 1024 * 1024)
    monkeypatch.setattr(s3_backend, "PART_SIZE", 5 * 1024 * 1024)
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(11 * 1024 * 1024))
    store.upload_file("big/src.bin", src)
    store.download_file("big/src.bin", tmp_path / "dst.bin")
    assert (tmp_path / "dst.bin").read_bytes() == src.read_bytes()
    if not isinstance(store, FileStore):
        assert store.stats["multipart_part"] + store.stats["stage_block"] == 3


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


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o077, 0o600)], ids=["umask-022", "umask-077"])
def test_every_file_the_filesystem_backend_writes_follows_the_umask(tmp_path, umask, mode):
    src = tmp_path / "src.bin"
    src.write_bytes(b"data")
    store = FileStore(tmp_path / "root")
    old = os.umask(umask)
    try:
        etag = store.write_bytes("c/.metadata", b"m")
        store.write_bytes("c/latest.json", b"1")
        store.write_bytes("c/latest.json", b"2", if_match=store.etag("c/latest.json"))
        store.write_bytes("c/.metadata", b"n", if_match=etag)
        assert store.write_if_absent("c/MANIFEST.json", b"{}")
        store.upload_file("c/uploaded.bin", src)
        writer = store.open_writer("c/__0_0.distcp")
        writer.write(b"shard")
        writer.close()
    finally:
        os.umask(old)
    modes = {key: stat.S_IMODE(os.stat(store.path(key)).st_mode) for key in store.list("c/")}
    assert modes == {key: mode for key in ["c/.metadata", "c/MANIFEST.json", "c/__0_0.distcp",
                                           "c/latest.json", "c/uploaded.bin"]}


def test_the_private_minio_calls_have_the_signatures_they_were_written_for():
    from minio import Minio

    for name, recorded in _MinioCalls.PINNED.items():
        now = str(inspect.signature(getattr(Minio, name)))
        assert now == recorded, (
            f"the installed minio changed the private Minio.{name}: {now} (written for {recorded}); "
            f"check components/core/store/s3.py _MinioCalls before updating PINNED")


def test_ranged_reads_fill_the_buffer_straight_from_the_socket(s3_env):
    store = open_store(s3_root(s3_env, "in-place"))
    store.write_bytes("blob", bytes(range(256)) * 16)
    resp = store.driver.client.get_object(store.driver.bucket, store._name("blob"), offset=16, length=32)
    try:
        assert _MinioCalls.socket_readinto(resp) is not None, "urllib3 no longer exposes _fp.readinto"
    finally:
        resp.close()
        resp.release_conn()
    buffer = bytearray(32)
    store.read_into("blob", 16, buffer)
    assert bytes(buffer) == bytes(range(16, 48))
