"""Other tools: stock torch reads a relaunch checkpoint (format 3) without relaunch, a checkpoint
exports to one torch.save or safetensors file, and a stock dcp.save folder imports as a committed
checkpoint; a folder that cannot be adopted leaves the store byte for byte as it was."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from relaunch.components.core.checkpoint import FORMAT_VERSION, CheckpointManager, step_key
from relaunch.components.core.store import open_store
from relaunch.pipelines.cli import main
from tests import warm_processes
from tests.core.helpers import assert_bitwise_equal, make_state, train_steps

ROOT = Path(__file__).resolve().parents[2]

# Runs in a fresh interpreter that cannot import relaunch (-I: no PYTHONPATH, no script directory).
STOCK = r'''
import json, sys
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

folder, expected_path, out = sys.argv[1], sys.argv[2], sys.argv[3]
expected = torch.load(expected_path, weights_only=True)
only = json.loads(sys.argv[4]) if len(sys.argv) > 4 else None


def zeros(value):
    if isinstance(value, torch.Tensor):
        return torch.zeros_like(value)
    if isinstance(value, dict):
        return {k: zeros(v) for k, v in value.items()}
    return value


def equal(a, b, path):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), path
    elif isinstance(a, dict):
        assert set(a) == set(b), (path, sorted(a), sorted(b))
        for k in a:
            equal(a[k], b[k], f"{path}.{k}")
    else:
        assert a == b, (path, a, b)


wanted = {k: expected[k] for k in only} if only else expected
state = zeros(wanted)
dcp.load(state, storage_reader=FileSystemReader(folder))
equal(wanted, state, "dcp.load")
dcp_to_torch_save(folder, out)
converted = torch.load(out, weights_only=False)
equal(wanted, {k: converted[k] for k in wanted}, "dcp_to_torch_save")
assert "relaunch" not in sys.modules
print("STOCK-OK")
'''


def _stock(tmp_path: Path, folder: str, expected: dict | str, only: list[str] | None = None) -> None:
    script = tmp_path / "stock_reader.py"
    script.write_text(STOCK)
    if isinstance(expected, dict):
        torch.save(expected, tmp_path / "expected.pt")
        expected = str(tmp_path / "expected.pt")
    args = [sys.executable, "-I", str(script), folder, expected, str(tmp_path / "converted.pt")]
    proc = subprocess.run(args + ([json.dumps(only)] if only else []), cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert proc.returncode == 0 and "STOCK-OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]


def _odd_state() -> dict:
    """Every kind of value a checkpoint holds: dtypes, shapes, views, non-tensor values."""
    g = torch.Generator().manual_seed(7)
    base = torch.randn(6, 10, generator=g)
    return {
        "w": torch.randn(300, 70, generator=g),
        "half": torch.randn(33, 5, generator=g).to(torch.bfloat16),
        "nested": {"i": torch.randint(-2**40, 2**40, (17,), generator=g), "flag": torch.rand(9, generator=g) > 0.5,
                   "empty": torch.empty(0, 4), "scalar": torch.tensor(3.5, dtype=torch.float64),
                   "c": torch.randn(4, generator=g, dtype=torch.complex64)},
        "view": base[2:4],  # a view: only its own bytes are stored
        "transposed": base.t(),  # non-contiguous
        "count": 7,
        "names": "a b c",
    }


def test_stock_dcp_load_and_dcp_to_torch_save_read_a_relaunch_checkpoint_without_relaunch(tmp_path):
    root = str(tmp_path / "store")
    saved = _odd_state()
    with CheckpointManager(root, owner="interop", async_save=False) as mgr:
        mgr.save(3, {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in saved.items()})
    manifest = json.loads(open_store(root).read_bytes(f"{step_key(3)}/MANIFEST.json"))
    assert manifest["format_version"] == FORMAT_VERSION == 3
    expected = {k: (v.contiguous() if isinstance(v, torch.Tensor) else v) for k, v in saved.items()}
    _stock(tmp_path, str(Path(root) / step_key(3)), expected)


def test_stock_torch_reads_a_relaunch_checkpoint_of_a_training_state(tmp_path):
    root = str(tmp_path / "store")
    state = make_state()
    train_steps(state, 2)
    with CheckpointManager(root, owner="interop", async_save=False) as mgr:
        mgr.save(2, state)
    _stock(tmp_path, str(Path(root) / step_key(2)), {"model": state.model.state_dict()}, only=["model"])


@pytest.mark.slow
def test_stock_torch_reads_a_checkpoint_sharded_over_2_fsdp_ranks(tmp_path):
    store = str(tmp_path / "store")
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node", "2",
           "-m", "tests.core.fsdp_worker", "--root", store, "--out", str(tmp_path / "w"), "--steps", "2",
           "--save-at", "2", "--width", "96"]
    proc = warm_processes.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
                              timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    files = {k for k in open_store(store).list(step_key(2) + "/") if k.endswith(".distcp")}
    assert {k.rsplit("/", 1)[1].split("_")[2] for k in files} == {"0", "1"}  # both ranks wrote shards
    full = torch.load(tmp_path / "w" / "step2.pt", weights_only=True)
    _stock(tmp_path, str(Path(store) / step_key(2)), {"model": full["model"]}, only=["model"])


def test_export_writes_what_dcp_to_torch_save_gives_and_safetensors_of_the_model(tmp_path, capsys):
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    root = str(tmp_path / "store")
    state = make_state()
    train_steps(state, 2)
    with CheckpointManager(root, owner="interop", async_save=False) as mgr:
        mgr.save(2, state)
        train_steps(state, 1)
        mgr.save(3, state)
    assert main(["checkpoints", "export", "--store", root, "--step", "2", "--to", str(tmp_path / "s2.pt")]) == 0
    assert main(["checkpoints", "export", "--store", root, "--to", str(tmp_path / "m.safetensors"),
                 "--format", "safetensors", "--json"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert json.loads(out[-1])["step"] == 3
    dcp_to_torch_save(Path(root) / step_key(2), tmp_path / "stock.pt")
    assert_bitwise_equal(torch.load(tmp_path / "stock.pt", weights_only=False),
                         torch.load(tmp_path / "s2.pt", weights_only=True))
    weights = load_file(tmp_path / "m.safetensors")
    assert weights.keys() == state.model.state_dict().keys()
    fresh = make_state(seed=5)
    fresh.model.load_state_dict(weights)
    assert_bitwise_equal(state.model.state_dict(), fresh.model.state_dict())


def test_import_adopts_a_stock_dcp_save_folder_as_the_latest_checkpoint_bitwise(tmp_path, capsys):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    root = str(tmp_path / "store")
    with CheckpointManager(root, owner="interop", async_save=False) as mgr:
        mgr.save(10, make_state(seed=1))
    state = make_state(seed=2)
    train_steps(state, 3)
    dcp.save(state.state_dict(), checkpoint_id=str(tmp_path / "stock"), no_dist=True)
    assert main(["checkpoints", "import", str(tmp_path / "stock"), "--store", root, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 11  # default: after the newest step
    store = open_store(root)
    assert json.loads(store.read_bytes("checkpoints/latest.json"))["step"] == 11
    assert not store.exists("checkpoints/LEASE.json")  # taken for the import, released after
    with CheckpointManager(root, async_save=False) as mgr:
        mgr.verify(11, deep=True)
        loaded = make_state(seed=9)
        assert mgr.load(loaded).step == 11
    assert_bitwise_equal(state.model.state_dict(), loaded.model.state_dict())
    assert_bitwise_equal(state.optimizer.state_dict()["state"], loaded.optimizer.state_dict()["state"])
    assert loaded.step == state.step == 3
    dcp_to_torch_save(tmp_path / "stock", tmp_path / "a.pt")
    dcp_to_torch_save(Path(root) / step_key(11), tmp_path / "b.pt")  # the structure is kept
    assert_bitwise_equal(torch.load(tmp_path / "a.pt", weights_only=False),
                         torch.load(tmp_path / "b.pt", weights_only=False))


class _Evil:
    def __reduce__(self):
        return (os.getcwd, ())


def _bad_folders(tmp_path: Path) -> dict[str, tuple[list[str], str]]:
    import torch.distributed.checkpoint as dcp

    good = tmp_path / "good"
    dcp.save({"w": torch.randn(64, 64), "n": 3}, checkpoint_id=str(good), no_dist=True)
    empty = tmp_path / "empty"
    empty.mkdir()
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / ".metadata").write_bytes(b"this is not a pickle")
    unsafe = tmp_path / "unsafe"
    unsafe.mkdir()
    (unsafe / ".metadata").write_bytes(pickle.dumps(_Evil()))
    truncated = tmp_path / "truncated"
    truncated.mkdir()
    for path in good.iterdir():
        data = path.read_bytes()
        (truncated / path.name).write_bytes(data if path.name == ".metadata" else data[: len(data) // 2])
    return {
        "no .metadata": ([str(empty)], "has no .metadata"),
        "not a folder": ([str(tmp_path / "missing")], "is not a directory"),
        "not a DCP folder": ([str(garbage)], "not a valid DCP metadata pickle"),
        "unsafe pickle in .metadata": ([str(unsafe)], "unsafe checkpoint metadata"),
        "truncated data": ([str(truncated)], "truncated"),
        "step already committed": ([str(good), "--step", "10"], "already committed"),
        "older than the latest": ([str(good), "--step", "4"], "older than the latest"),
    }


@pytest.mark.parametrize("case", ["no .metadata", "not a folder", "not a DCP folder", "unsafe pickle in .metadata",
                                  "truncated data", "step already committed", "older than the latest"])
def test_import_of_a_bad_folder_exits_2_with_one_line_and_leaves_the_store_byte_identical(tmp_path, capsys, case):
    root = tmp_path / "store"
    with CheckpointManager(str(root), owner="interop", async_save=False) as mgr:
        mgr.save(10, make_state(seed=1))
    before = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    modes = {p: p.stat().st_mtime_ns for p in before}
    argv, message = _bad_folders(tmp_path)[case]
    capsys.readouterr()
    assert main(["checkpoints", "import", *argv, "--store", str(root)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert {p: p.read_bytes() for p in root.rglob("*") if p.is_file()} == before
    assert {p: p.stat().st_mtime_ns for p in before} == modes


def test_import_into_and_export_from_an_s3_store_round_trip_bitwise(tmp_path, s3_env):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from tests.core.helpers import s3_root

    root = s3_root(s3_env, "interop")
    saved = _odd_state()
    dcp.save(saved, checkpoint_id=str(tmp_path / "stock"), no_dist=True)
    assert main(["checkpoints", "import", str(tmp_path / "stock"), "--store", root, "--step", "4"]) == 0
    assert main(["checkpoints", "export", "--store", root, "--to", str(tmp_path / "out.pt")]) == 0
    dcp_to_torch_save(tmp_path / "stock", tmp_path / "stock.pt")
    assert_bitwise_equal(torch.load(tmp_path / "stock.pt", weights_only=False),
                         torch.load(tmp_path / "out.pt", weights_only=True))
