"""``relaunch checkpoints list|latest|verify [--deep]``: JSON out, exit 2 on bad input, never writes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from components.core.checkpoint import CheckpointManager, step_key
from components.core.contract.errors import BadInput
from components.core.store import open_store
from pipelines.cli import main
from tests.core.helpers import make_state, train_steps


@pytest.fixture
def root(tmp_path):
    mgr = CheckpointManager(str(tmp_path / "store"), keep_last=0)
    state = make_state()
    for step in (9000, 10000):
        train_steps(state, 1)
        mgr.save(step, state, metrics={"val_loss": step / 1e4})
        mgr.wait()
    mgr.pin(9000, "registered")
    mgr.close()
    return str(tmp_path / "store")


def test_list_latest_and_verify_print_json(root, capsys):
    assert main(["checkpoints", "list", "--store", root, "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [r["step"] for r in listed] == [9000, 10000] and listed[0]["pinned"] == ["registered"]
    assert main(["checkpoints", "latest", "--store", root, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 10000
    assert main(["checkpoints", "verify", "--store", root, "--step", "9000", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True


@pytest.mark.parametrize("argv,message", [
    (["checkpoints", "verify", "--store", "s3://"], "no bucket"),
    (["checkpoints", "latest", "--store", "hdfs://b/x"], "not supported"),
    (["checkpoints", "list", "--store", "s3:/bucket/x"], "write it as s3://bucket/x"),
    (["checkpoints", "verify", "--step", "5"], "--store"),
    (["checkpoints", "frobnicate", "--store", "/tmp/x"], "invalid choice"),
    (["checkpoints", "list", "--store", "/nonexistent/relaunch-store"], "no such directory"),
    (["checkpoints", "latest", "--store", "file:///nonexistent/relaunch-store"], "no such directory"),
    (["checkpoints", "verify", "--deep", "--store", "/nonexistent/relaunch-store"], "no such directory"),
])
def test_bad_input_exits_2_with_one_line(argv, message):
    proc = subprocess.run([sys.executable, "-m", "pipelines.cli", *argv], capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and len(proc.stderr.strip().splitlines()) <= 2


def test_verify_of_a_missing_or_corrupt_checkpoint_exits_2(root, tmp_path, capsys):
    assert main(["checkpoints", "verify", "--store", root, "--step", "1"]) == 2
    assert main(["checkpoints", "verify", "--store", str(tmp_path / "empty")]) == 2
    store = open_store(root)
    store.write_bytes(f"{step_key(10000)}/__0_0.distcp", b"tampered")
    before = set(store.list())
    assert main(["checkpoints", "verify", "--store", root, "--step", "10000"]) == 2
    assert "__0_0.distcp has 8 bytes, the manifest says" in capsys.readouterr().err
    assert main(["checkpoints", "latest", "--store", root, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 9000
    added = set(store.list()) - before
    assert before <= set(store.list()) and [k.rsplit("/", 1)[0] for k in added] == ["checkpoints/quarantine"]


def _flip(store, key):
    data = bytearray(store.read_bytes(key))
    data[len(data) // 2] ^= 0x10
    store.write_bytes(key, bytes(data))


def test_verify_checks_files_and_sizes_and_verify_deep_reads_every_byte(root, capsys):
    store = open_store(root)
    _flip(store, f"{step_key(10000)}/__0_0.distcp")
    assert main(["checkpoints", "verify", "--store", root, "--step", "10000", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True  # sizes unchanged: only a read can tell
    assert main(["checkpoints", "verify", "--deep", "--store", root, "--step", "10000", "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["ok"] is False
    assert main(["checkpoints", "verify", "--deep", "--store", root, "--step", "9000"]) == 0


def test_a_checkpoint_of_a_newer_format_version_is_refused_with_exit_2_and_nothing_changes(root, capsys):
    store = open_store(root)
    key = f"{step_key(10000)}/MANIFEST.json"
    manifest = json.loads(store.read_bytes(key))
    manifest["format_version"] = 4
    store.write_bytes(key, json.dumps(manifest).encode())
    before = {k: store.read_bytes(k) for k in store.list()}
    for action in (["latest"], ["verify", "--step", "10000"], ["verify", "--deep", "--step", "10000"]):
        assert main(["checkpoints", *action, "--store", root]) == 2
        err = capsys.readouterr().err
        assert "format_version 4, written by a newer relaunch" in err and len(err.strip().splitlines()) == 1, err
    with pytest.raises(BadInput, match="newer relaunch"):
        with CheckpointManager(root) as mgr:
            mgr.load(make_state())
    assert {k: store.read_bytes(k) for k in store.list()} == before
