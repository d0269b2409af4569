"""The ``az://`` store against a real Azurite (tests/azure_server.py), pointed at it the way users
point the Azure SDK at an emulator: ``AZURE_STORAGE_CONNECTION_STRING`` with a ``BlobEndpoint``.

What Azurite does not emulate and how the gap is covered: it never drops a connection or answers
503/500 on its own (FaultProxy, a TCP proxy at the HTTP edge, resets connections and answers 503
here); it does not garbage-collect uncommitted blocks after 7 days as Azure does (relaunch does not
rely on that: ``abort_incomplete_uploads`` drops them, tested here); Entra ID / workload identity
tokens are not tested (no identity provider here).
"""

from __future__ import annotations

import datetime
import os
import uuid

import numpy as np
import pytest
import torch

from relaunch.components.core.contract.errors import BadInput, StoreUnwritable, TransientFailure
from relaunch.components.core.store import ObjectStore, PreconditionFailed, object_store, open_store, probe_writable
from relaunch.components.core.store import azure as azure_backend
from relaunch.components.core.store.object_store import PART_SLACK
from tests.azure_server import ACCOUNT, ACCOUNT_KEY
from tests.core.faults import FaultProxy, ScriptedProxy

MiB = 1024 * 1024


@pytest.fixture
def store(azure_env):
    return open_store(azure_env.root("store"))


def _no_azure_env(monkeypatch) -> None:
    for name in ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT", "AZURE_STORAGE_ACCOUNT_NAME",
                 "AZURE_STORAGE_KEY", "AZURE_STORAGE_SAS_TOKEN", "AZURE_STORAGE_BLOB_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    object_store.CHECKED.clear()


def test_bytes_round_trip_and_a_missing_key_is_file_not_found(store):
    store.write_bytes("a/b.json", b"{}")
    assert store.read_bytes("a/b.json") == b"{}" and store.exists("a/b.json")
    with pytest.raises(FileNotFoundError):
        store.read_bytes("a/missing")
    assert store.etag("a/missing") is None and not store.exists("a/missing")


def test_write_if_absent_creates_once_and_if_match_replaces_only_an_unchanged_blob(store):
    assert store.write_if_absent("lease.json", b"first") is True
    assert store.write_if_absent("lease.json", b"second") is False
    assert store.read_bytes("lease.json") == b"first"
    etag = store.etag("lease.json")
    new = store.write_bytes("lease.json", b"mine", if_match=etag)
    assert new and new != etag
    with pytest.raises(PreconditionFailed):
        store.write_bytes("lease.json", b"stale writer", if_match=etag)
    assert store.read_bytes("lease.json") == b"mine"


def test_a_conditional_replace_of_a_blob_deleted_since_it_was_read_fails(store):
    store.write_bytes("latest.json", b"1")
    etag = store.etag("latest.json")
    store.delete("latest.json")
    with pytest.raises(PreconditionFailed):
        store.write_bytes("latest.json", b"2", if_match=etag)
    assert not store.exists("latest.json")


def test_listing_is_relative_sorted_and_non_recursive_shows_directories(store):
    for key in ("c/x", "a/1", "a/2", "b/deep/3"):
        store.write_bytes(key, b"x")
    assert store.list() == ["a/1", "a/2", "b/deep/3", "c/x"]
    assert store.list("b/", recursive=False) == ["b/deep/"]
    assert store.sizes("a") == {"a/1": 1, "a/2": 1}
    store.delete_many(["a/1", "c/x", "never/was"])
    assert store.list() == ["a/2", "b/deep/3"]


def test_a_large_object_goes_up_as_staged_blocks_and_reads_back_into_a_tensor(store, tmp_path, monkeypatch):
    monkeypatch.setattr(azure_backend, "BLOCK_SIZE", 1 * MiB)
    data = os.urandom(5 * MiB + 123)
    writer = store.open_writer("big/stream.bin")
    for i in range(0, len(data), 300_000):
        writer.write(data[i:i + 300_000])
    writer.close()
    # five blocks: the 123 bytes past the fifth MiB ride with it (PART_SLACK), not in a block of their own
    assert store.stats["stage_block"] == 5 and store.stats["commit_block_list"] == 1
    tensor = torch.empty(2 * MiB + 100, dtype=torch.uint8)
    seen = []
    store.read_into("big/stream.bin", 3 * MiB, [tensor[:MiB].numpy(), tensor[MiB:].numpy()], sink=seen.append)
    assert bytes(tensor.numpy()) == data[3 * MiB:3 * MiB + len(tensor)]
    assert seen[0] == 0 and seen[-1] == len(tensor)
    src = tmp_path / "src.bin"
    src.write_bytes(data[:3 * MiB])
    store.upload_file("big/file.bin", src)
    store.download_file("big/file.bin", tmp_path / "back.bin")
    assert (tmp_path / "back.bin").read_bytes() == data[:3 * MiB]
    with pytest.raises(EOFError):
        store.read_into("big/file.bin", 3 * MiB - 10, np.empty(20, dtype=np.uint8))


def test_the_blocks_a_killed_writer_left_are_dropped_by_the_next_writer(store, azurite, monkeypatch):
    monkeypatch.setattr(azure_backend, "BLOCK_SIZE", 1 * MiB)
    store.write_bytes("ckpt/step-2/kept.bin", b"committed")
    killed = store.open_writer("ckpt/step-3/__0_0.distcp")
    killed.write(os.urandom(2 * MiB + MiB // PART_SLACK + 1))  # two blocks staged, never committed: the writer "dies" here
    for future in killed.parts:
        future.result()
    container = azurite.client().get_container_client("relaunch-ckpt")
    uncommitted = [b.name for b in container.list_blobs(name_starts_with=store.prefix,
                                                        include=["uncommittedblobs"])]
    assert any(n.endswith("step-3/__0_0.distcp") for n in uncommitted)
    assert store.list() == ["ckpt/step-2/kept.bin"]  # invisible to readers

    assert store.abort_incomplete_uploads("ckpt/") == 1
    assert store.abort_incomplete_uploads("ckpt/") == 0
    left = [b.name for b in container.list_blobs(name_starts_with=store.prefix, include=["uncommittedblobs"])]
    assert [n.split("/", 1)[1] for n in left] == ["ckpt/step-2/kept.bin"]
    assert store.read_bytes("ckpt/step-2/kept.bin") == b"committed"


@pytest.mark.parametrize("uri,message", [
    ("az://", "no container"),
    ("az://UPPER/x", "invalid"),
    ("az://a--b/x", "invalid"),
    ("az://acct:key@box/x", "must not carry"),
    ("az://box/../x", r"'\.\.'"),
])
def test_a_malformed_uri_is_bad_input_naming_the_problem(uri, message):
    with pytest.raises(BadInput, match=message):
        open_store(uri)


def test_a_missing_container_is_bad_input(azure_env):
    with pytest.raises(BadInput, match="container 'relaunch-no-such-container' does not exist"):
        open_store("az://relaunch-no-such-container/x")


def test_a_wrong_account_key_is_bad_input(azurite, monkeypatch):
    _no_azure_env(monkeypatch)
    azurite.create_container()
    wrong = azurite.connection_string().replace(ACCOUNT_KEY, "d3Jvbmc=" * 11)
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", wrong)
    with pytest.raises(BadInput, match="AZURE_STORAGE_CONNECTION_STRING"):
        open_store("az://relaunch-ckpt/x")


def test_no_credentials_at_all_is_bad_input_naming_the_variables(monkeypatch):
    _no_azure_env(monkeypatch)
    with pytest.raises(BadInput, match="AZURE_STORAGE_CONNECTION_STRING"):
        open_store("az://relaunch-ckpt/x")


def test_an_account_name_with_its_key_works_too(azurite, monkeypatch):
    _no_azure_env(monkeypatch)
    azurite.create_container()
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT", ACCOUNT)
    monkeypatch.setenv("AZURE_STORAGE_KEY", ACCOUNT_KEY)
    monkeypatch.setenv("AZURE_STORAGE_BLOB_ENDPOINT", azurite.endpoint)
    store = open_store(f"az://relaunch-ckpt/key-{uuid.uuid4().hex[:8]}")
    assert store.write_if_absent("x", b"1") and store.read_bytes("x") == b"1"


def test_a_sas_token_works_and_one_without_write_permission_cannot_write_exit_2(azurite, monkeypatch):
    from azure.storage.blob import ContainerSasPermissions, generate_container_sas

    _no_azure_env(monkeypatch)
    azurite.create_container()
    expiry = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(hours=1)

    def sas(permission: ContainerSasPermissions) -> str:
        return generate_container_sas(ACCOUNT, "relaunch-ckpt", account_key=ACCOUNT_KEY, permission=permission,
                                      expiry=expiry)

    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT", ACCOUNT)
    monkeypatch.setenv("AZURE_STORAGE_BLOB_ENDPOINT", azurite.endpoint)
    monkeypatch.setenv("AZURE_STORAGE_SAS_TOKEN", sas(ContainerSasPermissions(read=True, write=True, create=True,
                                                                              delete=True, list=True)))
    store = ObjectStore(azure_backend.AzureDriver("relaunch-ckpt"), f"sas-{uuid.uuid4().hex[:8]}")
    assert store.write_if_absent("x", b"1") and store.list() == ["x"]
    monkeypatch.setenv("AZURE_STORAGE_SAS_TOKEN", sas(ContainerSasPermissions(read=True, list=True)))
    read_only = ObjectStore(azure_backend.AzureDriver("relaunch-ckpt"), store.prefix)
    assert read_only.read_bytes("x") == b"1"
    with pytest.raises(StoreUnwritable, match="Azure refused") as refused:
        read_only.write_bytes("x", b"2")
    assert refused.value.exit_code == 2 and "cannot be written" in str(refused.value)
    with pytest.raises(StoreUnwritable, match="Azure refused"):
        probe_writable(read_only)  # what a training's start and prepare ask first


def test_an_unreachable_endpoint_is_a_transient_failure_after_bounded_retries(azurite, monkeypatch):
    from relaunch.components.core.runtime.net import free_port

    _no_azure_env(monkeypatch)
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING",
                       azurite.connection_string(f"http://127.0.0.1:{free_port()}/{ACCOUNT}"))
    with pytest.raises(TransientFailure, match="failed 3 times") as info:
        open_store("az://relaunch-ckpt/x", retries=3, backoff=0.01)
    assert info.value.exit_code == 138


def test_resets_and_503s_at_the_http_edge_are_retried_and_every_byte_arrives(azurite, monkeypatch):
    _no_azure_env(monkeypatch)
    azurite.create_container()
    proxy = FaultProxy(azurite.port, p_reset=0.15, p_reset_after=0.05, p_slowdown=0.1, seed=7).start()
    try:
        monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING",
                           azurite.connection_string(f"{proxy.endpoint}/{ACCOUNT}"))
        monkeypatch.setattr(azure_backend, "BLOCK_SIZE", 1 * MiB)
        store = open_store(f"az://relaunch-ckpt/flaky-{uuid.uuid4().hex[:8]}", retries=12, backoff=0.01)
        data = os.urandom(4 * MiB + 7)
        for i in range(6):
            assert store.write_if_absent(f"lease-{i}", f"holder {i}".encode())
        writer = store.open_writer("big.bin")
        writer.write(data)
        writer.close()
        buffer = np.empty(len(data), dtype=np.uint8)
        store.read_into("big.bin", 0, buffer)
        assert buffer.tobytes() == data
        assert [store.read_bytes(f"lease-{i}") for i in range(6)] == [f"holder {i}".encode() for i in range(6)]
    finally:
        proxy.stop()
    assert store.stats["retries"] > 0 and proxy.counts["slowdown"] + proxy.counts["reset"] > 0, proxy.counts


def test_an_az_uri_is_given_to_mlflow_by_its_wasbs_name_with_the_account_of_the_credentials(azure_env):
    import mlflow.data

    uri = azure_backend.wasbs_uri("az://relaunch-ckpt/run/datasets/v1")
    assert uri == f"wasbs://relaunch-ckpt@{ACCOUNT}.blob.core.windows.net/run/datasets/v1"
    assert mlflow.data.from_numpy(np.zeros((2, 2)), source=uri).source.uri == uri


@pytest.mark.parametrize("needle", ["if-none-match: *", "if-match:"])
def test_a_conditional_write_whose_answer_was_lost_is_read_back_and_counts_as_ours(azurite, monkeypatch, needle):
    _no_azure_env(monkeypatch)
    azurite.create_container()
    root = f"az://relaunch-ckpt/lost-{uuid.uuid4().hex[:8]}"
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite.connection_string())
    open_store(root).write_bytes("lease.json", b"old holder")
    etag = open_store(root).etag("lease.json") if needle == "if-match:" else None
    if needle != "if-match:":
        open_store(root).delete("lease.json")
    proxy = ScriptedProxy(azurite.port, [(needle, "reset_after", 1)]).start()  # it lands, its answer is lost
    try:
        monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite.connection_string(f"{proxy.endpoint}/{ACCOUNT}"))
        store = open_store(root, retries=4, backoff=0.01)
        if etag is None:
            assert store.write_if_absent("lease.json", b"new holder") is True
        else:
            assert store.write_bytes("lease.json", b"new holder", if_match=etag) == store.etag("lease.json")
    finally:
        proxy.stop()
    assert proxy.counts["reset_after"] == 1 and store.stats["conditional_read_back"] == 1
    # read back from Azurite itself: the proxy is gone (a kept-alive connection to it may be too)
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite.connection_string())
    assert open_store(root).read_bytes("lease.json") == b"new holder"
