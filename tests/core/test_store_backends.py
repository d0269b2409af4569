"""The store's seam: a backend is one class and one registration call, and then the configuration,
open_store and the checkpoint code take its URIs. And a path that starts like a URI written wrong
(``s3:/bucket/x``) is refused, never taken as a local directory."""

from __future__ import annotations

import collections
import hashlib
import threading
import types
from pathlib import Path

import pytest

from relaunch.components.core.checkpoint import CheckpointManager
from relaunch.components.core.contract.config_loading import load_config
from relaunch.components.core.contract.errors import BadInput
from relaunch.components.core.store import BACKENDS, PreconditionFailed, Segments, join_uri, open_store, register_backend
from relaunch.pipelines.cli import main
from tests.core.helpers import assert_bitwise_equal, fingerprint, make_state, save_three_steps


class MemStore:
    """A toy backend written outside the store package: ``mem://name/prefix``, held in this process."""

    scheme = "mem"
    example = "mem://name/prefix"
    spaces: dict[str, dict[str, bytes]] = collections.defaultdict(dict)
    lock = threading.Lock()

    def __init__(self, name: str, prefix: str):
        self.uri = f"mem://{name}/{prefix}".rstrip("/")
        self.objects = self.spaces[self.uri]
        self.stats: collections.Counter = collections.Counter()

    @classmethod
    def parse(cls, uri: str) -> tuple[str, str]:
        name, _, prefix = uri.split("://", 1)[1].partition("/")
        if not name:
            raise ValueError(f"mem URI {uri!r} has no name; write mem://name/prefix")
        return name, prefix.strip("/")

    @classmethod
    def open(cls, location: str, prefix: str, **options) -> "MemStore":
        return cls(location, prefix)

    def read_bytes(self, key):
        try:
            return self.objects[key]
        except KeyError:
            raise FileNotFoundError(self.uri_for(key)) from None

    def write_bytes(self, key, data, *, if_match=None):
        with self.lock:
            if if_match is not None and self.etag(key) != if_match:
                raise PreconditionFailed(f"{self.uri_for(key)} changed since it was read")
            self.objects[key] = bytes(data)
        return self.etag(key)

    def write_if_absent(self, key, data):
        with self.lock:
            if key in self.objects:
                return False
            self.objects[key] = bytes(data)
            return True

    def upload_file(self, key, path):
        self.write_bytes(key, Path(path).read_bytes())

    def download_file(self, key, path):
        Path(path).write_bytes(self.read_bytes(key))

    def read_into(self, key, offset, buffer, *, sink=None):
        segments = Segments(buffer)
        data = self.read_bytes(key)[offset:offset + segments.total]
        if len(data) < segments.total:
            raise EOFError(f"{self.uri_for(key)} is shorter than the range asked for")
        done = 0
        for view in segments.slices(0, segments.total):
            view[:] = data[done:done + len(view)]
            done += len(view)
        if sink is not None:
            sink(done)

    def open_writer(self, key):
        parts: list[bytes] = []
        return types.SimpleNamespace(write=lambda data: parts.append(bytes(data)),
                                     close=lambda: self.write_bytes(key, b"".join(parts)), abort=parts.clear)

    def sizes(self, prefix):
        base = prefix.rstrip("/") + "/"
        return {k: len(v) for k, v in list(self.objects.items()) if k.startswith(base) and "/" not in k[len(base):]}

    def exists(self, key):
        return key in self.objects

    def etag(self, key):
        data = self.objects.get(key)
        return None if data is None else hashlib.sha256(data).hexdigest()

    def list(self, prefix="", recursive=True):
        base = prefix.rstrip("/") + "/" if prefix.strip("/") else ""
        keys = [k for k in list(self.objects) if k.startswith(base)]
        if not recursive:
            keys = [base + k[len(base):].split("/")[0] + "/" if "/" in k[len(base):] else k for k in keys]
        return sorted(set(keys))

    def delete(self, key):
        self.objects.pop(key, None)

    def delete_many(self, keys):
        for key in keys:
            self.delete(key)

    def abort_incomplete_uploads(self, prefix):
        return 0

    def uri_for(self, key):
        return join_uri(self.uri, key)


@pytest.fixture
def mem_backend():
    register_backend(MemStore)  # the one registration call
    yield MemStore
    BACKENDS.pop(MemStore.scheme)


def test_an_unregistered_scheme_is_refused_by_the_config_and_by_open_store():
    with pytest.raises(BadInput, match="store.uri"):
        load_config(None, ["store.uri=mem://toy/exp"])
    with pytest.raises(BadInput, match="scheme 'mem' is not supported"):
        open_store("mem://toy/exp")


def test_a_backend_registered_from_a_test_file_serves_a_checkpoint_save_latest_load_round_trip(mem_backend):
    uri = "mem://toy/exp-1"
    assert load_config(None, [f"store.uri={uri}"]).store.uri == uri
    with pytest.raises(BadInput, match="has no name; write mem://name/prefix"):
        load_config(None, ["store.uri=mem:///exp"])
    store = open_store(uri)
    assert isinstance(store, MemStore) and store.uri == uri

    saved = save_three_steps(uri, owner="seam-test")

    reader = CheckpointManager(open_store(uri), owner="seam-test")
    assert reader.latest().step == 3
    restored = make_state(seed=99)
    info = reader.load(restored)
    reader.close()
    assert info.step == 3 and info.uri.startswith(uri + "/checkpoints/")
    assert_bitwise_equal(fingerprint(restored), saved)
    assert sorted({k.split("/")[1] for k in MemStore.spaces[uri] if k.startswith("checkpoints/step-")}) == [
        "step-000000000002", "step-000000000003"]  # keep_last=2 pruned step 1 through the same store


@pytest.mark.parametrize("uri, expected", [
    ("s3:/bucket/x", "write the URI as s3://bucket/x"),
    ("s3:bucket/x", "write the URI as s3://bucket/x"),
    ("S3:/bucket/x", "write the URI as s3://bucket/x"),
    ("file:/data/exp", "write the URI as file:///data/exp"),
    ("gs:foo", "write the URI as gs://foo"),
    ("hdfs:/x", "hdfs is not supported; use a path, file:///path"),
    ("az:/container/x", "write the URI as az://container/x"),
])
def test_a_path_starting_with_a_scheme_and_a_colon_is_refused_with_how_to_write_it(uri, expected, tmp_path,
                                                                                   monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(BadInput) as in_config:
        load_config(None, [f"store.uri={uri}"])
    assert "store.uri" in str(in_config.value) and expected in str(in_config.value)
    with pytest.raises(BadInput, match=f"for a local directory of that name write ./{uri}"):
        open_store(uri)
    assert list(tmp_path.iterdir()) == []


def test_a_registered_scheme_written_as_a_path_is_refused_too(mem_backend):
    with pytest.raises(BadInput, match="write the URI as mem://toy/x"):
        open_store("mem:toy/x")


@pytest.mark.parametrize("path", ["./s3:/bucket/x", "data/s3:x", "C:/data", "./notascheme:x"])
def test_a_path_with_a_colon_elsewhere_is_still_a_local_directory(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    store = open_store(path)
    assert store.uri == str((tmp_path / path).absolute())


def test_relaunch_run_refuses_a_store_uri_missing_its_slashes_in_one_line_and_writes_nothing(tmp_path, monkeypatch,
                                                                                             capsys):
    monkeypatch.chdir(tmp_path)
    code = main(["run", "--set", "store.uri=s3:/bucket/x"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and "s3://bucket/x" in err[0], err
    assert list(tmp_path.rglob("*")) == []
