"""A planted malicious ``.metadata`` pickle is refused with a clear error and runs no code."""

from __future__ import annotations

import io
import os
import pickle

import pytest
import torch

from relaunch.components.core.checkpoint import CheckpointManager, step_key
from relaunch.components.core.contract.errors import CorruptCheckpoint
from relaunch.components.core.checkpoint.safe_pickle import load_metadata
from relaunch.components.core.store import open_store
from tests.core.helpers import make_state, s3_root, train_steps


class _Payload:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _plant(store, key: str, payload: bytes) -> None:
    """Replace a committed checkpoint's .metadata and re-seal its manifest, as an attacker with write
    access to the store could (the manifest's digest is no signature): every digest check passes,
    only the unpickler stands in the way."""
    import json

    from relaunch.components.core.checkpoint.layout import sealed_manifest_body
    from relaunch.components.core.checkpoint.verify import digest

    store.write_bytes(f"{key}/.metadata", payload)
    manifest = json.loads(store.read_bytes(f"{key}/MANIFEST.json"))
    manifest["files"][".metadata"] = {"size": len(payload), "chunks": [[0, len(payload), digest(payload)]]}
    store.write_bytes(f"{key}/MANIFEST.json", sealed_manifest_body(manifest))


@pytest.fixture(params=["fs", "s3"])
def root(request, tmp_path):
    if request.param == "fs":
        return str(tmp_path / "store")
    return s3_root(request.getfixturevalue("s3_env"), "pickle")


def test_a_malicious_metadata_pickle_is_refused_and_runs_nothing(root, tmp_path):
    marker = tmp_path / "pwned"
    state = make_state()
    mgr = CheckpointManager(root, owner="pickle-test")
    train_steps(state, 1)
    mgr.save(1, state)
    mgr.wait()
    mgr.close()
    _plant(open_store(root), step_key(1), pickle.dumps(_Payload(str(marker))))
    with pytest.raises(CorruptCheckpoint, match=r"unsafe checkpoint metadata: it references (posix|os)\.system"):
        CheckpointManager(root).load(make_state(), step=1)
    assert not marker.exists()


@pytest.mark.parametrize("payload", [
    pickle.dumps(_Payload("/tmp/relaunch-should-not-exist")),
    b"cos\nsystem\n(S'true'\ntR.",                     # protocol 0 GLOBAL os.system
    pickle.dumps(eval),                                 # builtins.eval
    pickle.dumps(torch.load),                           # a torch function, not a metadata type
    b"\x80\x04garbage",                                 # truncated stream
])
def test_the_restricted_unpickler_refuses_anything_but_dcp_metadata(payload):
    with pytest.raises(CorruptCheckpoint):
        load_metadata(io.BytesIO(payload))
    assert not os.path.exists("/tmp/relaunch-should-not-exist")


def test_real_dcp_metadata_loads_through_the_restricted_unpickler(tmp_path):
    mgr = CheckpointManager(str(tmp_path), owner="pickle-test")
    state = make_state()
    train_steps(state, 1)
    mgr.save(3, state)
    mgr.wait()
    metadata = load_metadata((tmp_path / step_key(3) / ".metadata").read_bytes())
    assert any(k.startswith("model.") for k in metadata.state_dict_metadata)


def test_a_non_tensor_item_that_needs_a_full_unpickle_is_refused(tmp_path):
    """A bytes item in a shard is loaded with torch.load(weights_only=True)."""
    import torch.distributed.checkpoint as dcp

    marker = tmp_path / "pwned2"
    target = tmp_path / "store" / step_key(1)
    dcp.save({"x": torch.zeros(2), "evil": _Payload(str(marker))}, checkpoint_id=str(target))
    import hashlib
    import json

    files = {p.name: {"size": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
             for p in target.iterdir()}
    (target / "MANIFEST.json").write_text(json.dumps({"format_version": 1, "step": 1, "files": files}))
    state = {"x": torch.ones(2), "evil": None}
    with pytest.raises(CorruptCheckpoint, match="weights_only"):
        CheckpointManager(str(tmp_path / "store")).load(state, step=1)
    assert not marker.exists()
