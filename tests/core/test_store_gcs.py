"""The gs:// store against a GCS emulator (fake-gcs-server, started by the tests and reached through
STORAGE_EMULATOR_HOST only; tests/gcs_server.py says what it emulates), with tests/core/faults.py's
proxies dropping connections and answering 503 in front of it."""

from __future__ import annotations

import os

import pytest

from relaunch.components.core.contract.errors import BadInput, TransientFailure
from relaunch.components.core.store import GCSDriver, PreconditionFailed, open_store
from relaunch.components.core.store import gcs as gcs_backend
from tests.core.faults import FaultProxy, ScriptedProxy


@pytest.fixture
def store(gcs_env):
    return open_store(gcs_env.root("store"))


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(gcs_backend, "CHUNK_SIZE", 256 * 1024)  # GCS's smallest chunk


def test_bytes_round_trip_and_a_missing_key_is_file_not_found(store):
    assert isinstance(store.driver, GCSDriver)
    store.write_bytes("a/b.txt", b"hello")
    assert store.read_bytes("a/b.txt") == b"hello"
    assert store.exists("a/b.txt") and not store.exists("a/c.txt")
    with pytest.raises(FileNotFoundError):
        store.read_bytes("a/c.txt")
    with pytest.raises(FileNotFoundError):
        store.read_into("a/c.txt", 0, bytearray(4))


def test_write_if_absent_creates_once_by_a_generation_precondition(store):
    assert store.write_if_absent("lock", b"one") is True
    assert store.write_if_absent("lock", b"two") is False
    assert store.read_bytes("lock") == b"one"


def test_a_create_if_absent_of_an_existing_key_is_refused_by_the_server_as_precondition_failed(store):
    store.write_bytes("taken", b"first")
    with pytest.raises(PreconditionFailed, match="exists or changed"):
        store.write_bytes("taken", b"second", if_match="0")  # ifGenerationMatch=0: create only
    assert store.read_bytes("taken") == b"first" and store.stats["put"] == 2


def test_a_conditional_write_above_one_chunk_is_still_one_request_the_server_evaluates(store, small_chunks):
    # fake-gcs-server 1.54 ignores ifGenerationMatch on resumable sessions: a conditional write never opens one
    big = os.urandom(256 * 1024 * 2)
    assert store.write_if_absent("big-lock", big) is True
    assert store.write_if_absent("big-lock", os.urandom(len(big))) is False
    assert store.read_bytes("big-lock") == big and store.stats["resumable_start"] == 0


def test_a_conditional_replace_fails_when_the_generation_changed(store):
    first = store.write_bytes("p.json", b"1")
    assert first == store.etag("p.json")
    second = store.write_bytes("p.json", b"2", if_match=first)
    with pytest.raises(PreconditionFailed):
        store.write_bytes("p.json", b"3", if_match=first)
    assert store.read_bytes("p.json") == b"2" and store.etag("p.json") == second


def test_a_conditional_replace_of_a_key_deleted_since_it_was_read_fails(store):
    etag = store.write_bytes("p.json", b"1")
    store.delete("p.json")
    with pytest.raises(PreconditionFailed):
        store.write_bytes("p.json", b"2", if_match=etag)
    assert not store.exists("p.json")


def test_listing_is_relative_sorted_and_non_recursive_shows_directories(store):
    for key in ["c/step-2/x", "c/step-10/y", "c/latest.json", "other"]:
        store.write_bytes(key, b".")
    assert store.list("c/") == ["c/latest.json", "c/step-10/y", "c/step-2/x"]
    assert store.list("c/", recursive=False) == ["c/latest.json", "c/step-10/", "c/step-2/"]
    assert store.sizes("c/step-2") == {"c/step-2/x": 1}
    store.delete_many(["c/step-10/y", "c/step-2/x"])
    store.delete("c/latest.json")
    store.delete("c/never-existed")
    assert store.list("c/") == []
    assert store.uri_for("other").endswith("/other")


def test_a_ranged_read_fills_a_list_of_buffers_and_a_short_object_is_eof(store):
    blob = bytes(range(256)) * 4096  # 1 MiB: more than one read block
    store.write_bytes("blob", blob)
    a, b = bytearray(100), bytearray(700 * 1024)
    seen = []
    store.read_into("blob", 16, [a, b], sink=seen.append)
    assert bytes(a) + bytes(b) == blob[16:16 + 100 + 700 * 1024]
    assert seen[0] == 0 and seen[-1] == 100 + 700 * 1024
    with pytest.raises(EOFError):
        store.read_into("blob", len(blob) - 10, bytearray(20))


def test_a_ranged_read_fills_the_buffers_straight_from_the_socket(store):
    # urllib3's readinto reads into a new bytes object and copies it; http.client's (urllib3 2.x's
    # private ``_fp``) fills ours: the restore of 128 MiB on the emulator, 0.49 -> 0.41 s (medians)
    import http.client

    store.write_bytes("blob", bytes(range(256)) * 64)
    with store.driver.open_range(store._name("blob"), 16, 32) as readinto:
        assert isinstance(getattr(readinto, "__self__", None), http.client.HTTPResponse), (
            "urllib3 no longer exposes _fp.readinto: see object_store.socket_readinto")
        buffer = bytearray(32)
        assert readinto(memoryview(buffer)) == 32
    assert bytes(buffer) == bytes(range(16, 48))


def test_a_large_streamed_write_goes_up_as_resumable_chunks_and_nothing_shows_before_close(store, small_chunks):
    data = os.urandom(256 * 1024 * 3 + 1000)
    writer = store.open_writer("c/big.bin")
    for i in range(0, len(data), 100_000):
        writer.write(data[i:i + 100_000])
    assert not store.exists("c/big.bin")
    writer.close()
    assert store.read_bytes("c/big.bin") == data
    # three chunks: the 1000 bytes past the third ride with it (PART_SLACK), not in a request of their own
    assert store.stats["resumable_start"] == 1 and store.stats["resumable_chunk"] == 3


def test_an_aborted_writer_leaves_no_object_and_no_upload_to_abort(store, small_chunks):
    dropped = store.open_writer("c/dropped.bin")
    dropped.write(os.urandom(256 * 1024 * 2 + 5))
    dropped.abort()
    small = store.open_writer("c/small.bin")
    small.write(b"x" * 10)
    small.close()
    assert store.list("c/") == ["c/small.bin"]
    assert store.abort_incomplete_uploads("c") == 0
    assert store.stats["resumable_cancel"] == 1


def test_files_up_and_down_intact(store, tmp_path, small_chunks):
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(256 * 1024 * 2 + 7))
    store.upload_file("big/src.bin", src)
    store.download_file("big/src.bin", tmp_path / "dst.bin")
    assert (tmp_path / "dst.bin").read_bytes() == src.read_bytes()
    assert store.stats["resumable_chunk"] == 2  # the 7 bytes ride with the second


@pytest.mark.parametrize("uri,message", [
    ("gs://", "no bucket"),
    ("gs://user:secret@bucket/x", "must not carry credentials"),
    ("gs://UPPER/x", "invalid"),
    ("gs://a/x", "invalid"),
    ("gs://bucket/../x", r"'\.\.'"),
])
def test_a_malformed_gs_uri_is_bad_input_naming_the_problem(uri, message):
    with pytest.raises(BadInput, match=message):
        open_store(uri)


def test_a_missing_bucket_is_bad_input(gcs_env):
    with pytest.raises(BadInput, match="bucket 'relaunch-no-such-bucket' does not exist") as err:
        open_store("gs://relaunch-no-such-bucket/x")
    assert err.value.exit_code == 2


def test_unusable_credentials_are_bad_input_in_one_line(tmp_path, monkeypatch):
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    key = tmp_path / "key.json"
    key.write_text('{"type": "service_account", "client_email": "x"}')  # no private key
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(key))
    with pytest.raises(BadInput) as err:
        open_store("gs://some-bucket/x")
    assert err.value.exit_code == 2 and "GOOGLE_APPLICATION_CREDENTIALS" in str(err.value)
    assert len(str(err.value).splitlines()) == 1


def test_an_unreachable_endpoint_is_a_transient_failure_after_bounded_retries(monkeypatch):
    from tests.services import free_port

    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{free_port()}")
    with pytest.raises(TransientFailure, match="failed 3 times") as err:
        open_store("gs://bucket-x/x", retries=3, backoff=0.01)
    assert err.value.exit_code == 138


def test_every_operation_survives_resets_and_503s(gcs_env, monkeypatch):
    # objects below one chunk: a resumable chunk's retry asks the session where it stands, which
    # fake-gcs-server does not emulate (test_a_resumable_chunk_whose_answer_was_lost_... covers it)
    proxy = FaultProxy(gcs_env.port, p_reset=0.1, p_reset_after=0.05, p_slowdown=0.1, seed=7).start()
    try:
        root = gcs_env.root("flaky")
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.endpoint)
        store = open_store(root, retries=12, backoff=0.01)
        data = os.urandom(256 * 1024 * 4 + 3)
        for i in range(3):
            writer = store.open_writer(f"d/{i}.bin")
            writer.write(data)
            writer.close()
            buffer = bytearray(len(data))
            store.read_into(f"d/{i}.bin", 0, buffer)
            assert bytes(buffer) == data
        assert store.write_if_absent("d/lock", b"me") is True
        assert store.write_if_absent("d/lock", b"other") is False
        etag = store.etag("d/lock")
        store.write_bytes("d/lock", b"me again", if_match=etag)
        assert store.list("d/") == ["d/0.bin", "d/1.bin", "d/2.bin", "d/lock"]
        assert store.stats["retries"] > 0 and proxy.counts["reset"] + proxy.counts["slowdown"] > 0
    finally:
        proxy.stop()


def test_a_create_whose_answer_was_lost_is_read_back_and_counts_as_created(gcs_env, monkeypatch):
    proxy = ScriptedProxy(gcs_env.port, [("ifgenerationmatch=0", "reset_after", 1)]).start()
    try:
        root = gcs_env.root("lost")
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.endpoint)
        store = open_store(root, backoff=0.01)
        assert store.write_if_absent("lease", b"holder-1") is True
        assert store.stats["conditional_read_back"] == 1 and proxy.counts["reset_after"] == 1
        assert store.write_if_absent("lease", b"holder-2") is False
    finally:
        proxy.stop()


@pytest.mark.parametrize("server", [
    pytest.param("gcs_server", marks=pytest.mark.xfail(
        strict=True, raises=TransientFailure, reason="fake-gcs-server 1.54 finalizes a resumable session at a status "
        "query (fsouza/fake-gcs-server#1362, #2354): the store refuses that answer; GCS answers 308 with Range")),
    "ignoring_gcs_server",  # gcp-storage-emulator answers status queries as GCS does
])
def test_a_resumable_chunk_whose_answer_was_lost_resumes_where_the_server_stands(server, request, monkeypatch,
                                                                                  small_chunks):
    server = request.getfixturevalue(server)
    proxy = ScriptedProxy(server.port, [("content-range: bytes 262144-", "reset_after", 1)]).start()
    try:
        root = server.root("resume")
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.endpoint)
        store = open_store(root, backoff=0.01)
        data = os.urandom(256 * 1024 * 3)
        writer = store.open_writer("big.bin")
        writer.write(data)
        writer.close()
        assert proxy.counts["reset_after"] == 1 and store.stats["retries"] == 1
        assert store.read_bytes("big.bin") == data
    finally:
        proxy.stop()


def test_no_store_operation_draws_from_the_training_rng_stream(store, small_chunks):
    import random

    random.seed(1234)
    expected = random.random()
    random.seed(1234)
    store.write_bytes("r/a", b"x")
    assert store.write_if_absent("r/b", b"y")
    store.write_bytes("r/a", b"z", if_match=store.etag("r/a"))
    writer = store.open_writer("r/c")
    writer.write(os.urandom(256 * 1024 + 1))
    writer.close()
    store.read_into("r/c", 0, bytearray(10))
    store.list("r/")
    assert random.random() == expected


def test_a_403_from_gcs_is_bad_input_at_once_in_one_line(gcs_env, monkeypatch):
    from tests.core import faults

    body = b'{"error": {"code": 403, "message": "caller does not have storage.buckets.get access"}}'
    monkeypatch.setitem(faults._ANSWERS, "forbidden", (b"403 Forbidden", body))
    proxy = ScriptedProxy(gcs_env.port, [("get ", "forbidden", None)]).start()
    try:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.endpoint)
        with pytest.raises(BadInput, match="GCS refused bucket_get") as err:
            open_store(gcs_env.root("forbidden"), backoff=0.01)
        assert err.value.exit_code == 2 and len(str(err.value).splitlines()) == 1
        assert proxy.counts["forbidden"] == 1  # not retried
    finally:
        proxy.stop()
