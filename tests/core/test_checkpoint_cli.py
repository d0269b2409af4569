"""``relaunch checkpoints list|latest|verify [--deep]``: JSON out, exit 2 on bad input, never writes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from relaunch.components.core.checkpoint import CheckpointManager, step_key
from relaunch.components.core.contract.errors import BadInput
from relaunch.components.core.store import open_store
from relaunch.pipelines.cli import main
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
    (["checkpoints", "list", "--store", "s3:/bucket/x"], "write the URI as s3://bucket/x"),
    (["checkpoints", "verify", "--step", "5"], "--store"),
    (["checkpoints", "frobnicate", "--store", "/tmp/x"], "invalid choice"),
    (["checkpoints", "list", "--store", "/nonexistent/relaunch-store"], "no such directory"),
    (["checkpoints", "latest", "--store", "file:///nonexistent/relaunch-store"], "no such directory"),
    (["checkpoints", "verify", "--deep", "--store", "/nonexistent/relaunch-store"], "no such directory"),
])
def test_bad_input_exits_2_with_one_line(argv, message):
    proc = subprocess.run([sys.executable, "-m", "relaunch.pipelines.cli", *argv], capture_output=True, text=True)
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


@pytest.fixture
def trainings_root(tmp_path):
    """A store root as `relaunch run` leaves it: two trainings under trainings/<UTC time>/, nothing else."""
    root = tmp_path / "store"
    for name, steps in (("20261204-030015", (20, 40)), ("20261204-031502", (20, 40, 60))):
        mgr = CheckpointManager(str(root / "trainings" / name), keep_last=0, async_save=False)
        state = make_state()
        for step in steps:
            train_steps(state, 1)
            mgr.save(step, state, metrics={"val_loss": 1 / 3 + step, "val_accuracy": 0.876543})
        if name.endswith("502"):
            mgr.pin(40, "registered-as-relaunch-digits-v12")
        mgr.close()
    return root


def _cli(*argv: str, columns: int = 80) -> subprocess.CompletedProcess:
    import os

    env = {**os.environ, "COLUMNS": str(columns)}
    return subprocess.run([sys.executable, "-m", "relaunch.pipelines.cli", *argv], capture_output=True, text=True, env=env)


def test_list_of_a_store_root_shows_every_training_that_relaunch_run_wrote(trainings_root, capsys):
    assert main(["checkpoints", "list", "--store", str(trainings_root), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["training"], r["step"]) for r in rows] == [("20261204-030015", 20), ("20261204-030015", 40),
                                                          ("20261204-031502", 20), ("20261204-031502", 40),
                                                          ("20261204-031502", 60)]
    assert rows[-1]["uri"].endswith("trainings/20261204-031502/checkpoints/step-000000000060")


def test_latest_and_verify_of_a_store_root_read_the_newest_training_or_the_one_named(trainings_root, capsys):
    assert main(["checkpoints", "latest", "--store", str(trainings_root), "--json"]) == 0
    latest = json.loads(capsys.readouterr().out)
    assert (latest["training"], latest["step"]) == ("20261204-031502", 60)
    assert main(["checkpoints", "verify", "--store", str(trainings_root), "--training", "20261204-030015",
                 "--json"]) == 0
    verified = json.loads(capsys.readouterr().out)
    assert (verified["training"], verified["step"], verified["ok"]) == ("20261204-030015", 40, True)
    assert main(["checkpoints", "list", "--store", str(trainings_root), "--training", "20261204-030015",
                 "--uris"]) == 0
    assert [u.rsplit("/", 1)[-1] for u in capsys.readouterr().out.split()] == ["step-000000000020",
                                                                              "step-000000000040"]


def test_an_unknown_training_is_one_line_naming_the_nearest(trainings_root):
    proc = _cli("checkpoints", "list", "--store", str(trainings_root), "--training", "20261204-031503")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "did you mean '20261204-031502'?" in proc.stderr


@pytest.mark.parametrize("columns", [80, 100])
def test_the_list_table_fits_the_terminal_with_formatted_numbers_and_whole_uris(trainings_root, columns):
    proc = _cli("checkpoints", "list", "--store", str(trainings_root), columns=columns)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    base = f"{trainings_root}/trainings/20261204-031502/checkpoints/"
    assert any(base in line for line in lines), "the checkpoints folder, whole, on a line of its own"
    table = [line for line in lines if base not in line and str(trainings_root) not in line]
    assert max(len(line) for line in table) <= columns, table
    assert "40.33" in proc.stdout and "0.8765" in proc.stdout and "0.333333" not in proc.stdout
    assert "KiB" in proc.stdout and "[]" not in proc.stdout
    assert any(line.rstrip().endswith("-") for line in table), "not pinned is '-'"


def test_locate_by_hand_agrees_with_the_newest_training_of_the_root(trainings_root):
    import os

    proc = subprocess.run([sys.executable, "-m", "relaunch.components.locate", "--set", f"store.uri={trainings_root}"],
                          capture_output=True, text=True, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found["step"] == 60 and found["checkpoint_uri"].endswith("20261204-031502/checkpoints/step-000000000060")
    with CheckpointManager(str(trainings_root / "trainings" / "20261204-031502"), async_save=False) as mgr:
        assert mgr.latest().uri == found["checkpoint_uri"]  # what the pipeline's locate gives that training
    older = subprocess.run([sys.executable, "-m", "relaunch.components.locate", "--set", f"store.uri={trainings_root}",
                            "--input", "training=20261204-030015"], capture_output=True, text=True)
    assert json.loads(older.stdout.strip().splitlines()[-1])["step"] == 40
