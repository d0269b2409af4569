"""The private torch names relaunch leans on, all in components/core/checkpoint/torch_private.py, each with
the shape our code was written for: a torch upgrade that changes one fails here, loudly and by name,
instead of somewhere inside a save or a load. And the public replacements of the private names relaunch
used before, each checked against what torch itself does.

Kept private (torch 2.13 has no public way; why in torch_private.py):
- ``filesystem._StorageInfo``: pickled into ``.metadata`` under that name (the stored format).
- ``DTensor(local, spec)`` with ``DTensor._spec``: a DTensor over a CPU snapshot of a shard.
- ``state_dict._get_fqns``: the names DCP gives a parameter (components/core/trainer/state.py).

Replaced: ``filesystem._split_by_size_and_type`` and ``_StoragePrefix`` (dcp_io.split_by_size_and_type, a
plain prefix string), ``_traverse.set_element`` (dcp_io.place), ``DTensor._local_tensor`` (``to_local()``),
``utils._create_file_view``, ``torch._C.PyTorchFileReader`` and ``_checkpoint_offset`` (legacy_v1's
FileWindow and archive_payload, through ``zipfile``), ``torch._C._set_deterministic_algorithms``
(``torch.set_deterministic_debug_mode``). The standard library's: tests/core/test_private_stdlib.py.
"""

from __future__ import annotations

import dataclasses
import inspect
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

ROOT = Path(__file__).resolve().parents[2]


def _params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def test_the_private_torch_names_relaunch_uses_have_the_shape_it_was_written_for():
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.state_dict import _get_fqns
    from torch.distributed.tensor import DTensor

    from relaunch.components.core.checkpoint.torch_private import storage_info

    info = storage_info("__0_0.distcp", 7, 11)
    # the module and name every .metadata written so far refers to (and safe_pickle admits)
    assert (type(info).__module__, type(info).__qualname__) == ("torch.distributed.checkpoint.filesystem",
                                                              "_StorageInfo")
    assert type(info) is _StorageInfo
    assert [f.name for f in dataclasses.fields(_StorageInfo)][:3] == ["relative_path", "offset", "length"]
    assert (info.relative_path, info.offset, info.length) == ("__0_0.distcp", 7, 11)
    assert "_spec" in DTensor.__slots__  # DTensor(local, spec, requires_grad=...) is a builtin: called in the next test
    assert _params(_get_fqns)[:2] == ["model", "name"]


def test_a_tensor_record_of_torch_save_is_rebuilt_by_the_global_dcp_io_writes(tmp_path):
    import io
    import zipfile

    import torch
    from torch._utils import _rebuild_tensor_v2

    from relaunch.components.core.checkpoint.torch_private import TENSOR_REBUILD_GLOBAL

    buffer = io.BytesIO()
    torch.save(torch.arange(6, dtype=torch.float32).reshape(2, 3), buffer)
    with zipfile.ZipFile(buffer) as archive:
        (pickled,) = [archive.read(n) for n in archive.namelist() if n.endswith("/data.pkl")]
    assert pickled.startswith(b"\x80\x02" + TENSOR_REBUILD_GLOBAL), pickled[:60]
    assert callable(_rebuild_tensor_v2) and _params(_rebuild_tensor_v2)[:4] == ["storage", "storage_offset", "size", "stride"]


_DTENSOR_LIKE = """
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from relaunch.components.core.checkpoint.torch_private import dtensor_like
from relaunch.components.core.checkpoint.snapshot import local_part

dist.init_process_group("gloo", init_method="file://{pg}", rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
live = torch.nn.Parameter(distribute_tensor(torch.arange(12.0).reshape(3, 4), mesh, [Shard(0)]))
local = local_part(live)
assert type(local) is not DTensor and local.untyped_storage().data_ptr() == live.to_local().untyped_storage().data_ptr()
assert local.grad_fn is None
buf = torch.zeros(3, 4)
copy = dtensor_like(buf, live)
assert isinstance(copy, DTensor) and not copy.requires_grad
assert local_part(copy) is buf
assert copy.shape == live.shape and copy.stride() == live.stride()
assert copy.placements == live.placements and copy.device_mesh == live.device_mesh
dist.destroy_process_group()
print("ok")
"""


def test_a_snapshot_dtensor_keeps_its_buffer_and_the_live_dtensors_layout(tmp_path):
    proc = subprocess.run([sys.executable, "-c", _DTENSOR_LIKE.format(pg=tmp_path / "pg")], cwd=ROOT,
                          capture_output=True, text=True, timeout=180,
                          env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def _state() -> dict:
    torch.manual_seed(0)
    return {"w": {str(i): torch.randn(1000 * (i + 1)) for i in range(7)},
            "h": torch.randn(40).to(torch.float16), "n": 5, "note": "x"}


def _files_of(path: Path) -> dict[str, str]:
    from relaunch.components.core.checkpoint.legacy_v1 import read_metadata

    return {index.fqn: info.relative_path for index, info in read_metadata(path).storage_data.items()}


def test_our_writer_deals_the_items_of_a_rank_into_files_as_dcps_filesystem_writer_does(tmp_path):
    from relaunch.components.core.checkpoint.dcp_io import StoreWriter
    from relaunch.components.core.store import FileStore

    dcp.save(_state(), storage_writer=FileSystemWriter(tmp_path / "stock", thread_count=3), no_dist=True)
    dcp.save(_state(), storage_writer=StoreWriter(FileStore(tmp_path / "ours"), "ckpt", files_per_rank=3),
             no_dist=True)
    ours = _files_of(tmp_path / "ours" / "ckpt")
    assert len(set(ours.values())) == 3
    assert ours == _files_of(tmp_path / "stock")


def test_the_safe_load_planner_puts_nested_values_where_dcps_default_planner_does(tmp_path):
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    from relaunch.components.core.checkpoint.dcp_io import safe_load_planner

    saved = {"t": torch.arange(3.0), "rng": [{"seed": 7, "name": "a"}, [1, 2, {"deep": "z"}]], "opt": {"lr": 0.5}}
    dcp.save(saved, storage_writer=FileSystemWriter(tmp_path), no_dist=True)

    def template():
        return {"t": torch.zeros(3), "rng": [{"seed": 0, "name": ""}, [0, 0, {"deep": ""}]], "opt": {"lr": 0.0}}

    stock, safe = template(), template()
    dcp.load(stock, storage_reader=FileSystemReader(tmp_path), planner=DefaultLoadPlanner(), no_dist=True)
    dcp.load(safe, storage_reader=FileSystemReader(tmp_path), planner=safe_load_planner(), no_dist=True)
    assert safe["rng"] == stock["rng"] == saved["rng"] and safe["opt"] == stock["opt"] == saved["opt"]
    assert torch.equal(safe["t"], saved["t"])


def test_a_large_tensor_of_a_stock_checkpoint_is_found_in_its_archive_and_read_straight_into_place(tmp_path):
    from relaunch.components.core.checkpoint.legacy_v1 import DIRECT_MIN_BYTES, FileWindow, archive_payload, read_metadata
    from relaunch.components.core.checkpoint.legacy_v1 import safe_reader

    big = torch.randn(DIRECT_MIN_BYTES // 4 + 1000)
    saved = {"big": big, "small": torch.arange(5, dtype=torch.int16), "n": 3}
    dcp.save(saved, storage_writer=FileSystemWriter(tmp_path), no_dist=True)
    for index, info in read_metadata(tmp_path).storage_data.items():
        with open(tmp_path / info.relative_path, "rb") as stream:
            found = archive_payload(FileWindow(stream, info.offset, info.length))
            if index.fqn == "n":  # a pickled int: no tensor storage in its archive
                assert found is None
                continue
            offset, size = found
            stream.seek(info.offset + offset)
            assert stream.read(size) == saved[index.fqn].numpy().tobytes(), index.fqn
    assert archive_payload(FileWindow(open(tmp_path / ".metadata", "rb"), 0, 100)) is None  # not an archive

    loaded = {"big": torch.zeros_like(big), "small": torch.zeros(5, dtype=torch.int16), "n": 0}
    place = loaded["big"].data_ptr()
    from relaunch.components.core.checkpoint.dcp_io import safe_load_planner

    dcp.load(loaded, storage_reader=safe_reader(tmp_path), planner=safe_load_planner(), no_dist=True)
    assert torch.equal(loaded["big"], big) and loaded["big"].data_ptr() == place
    assert torch.equal(loaded["small"], saved["small"]) and loaded["n"] == 3


def test_deterministic_training_on_cpu_turns_deterministic_kernels_on_without_importing_inductor():
    code = ("import sys, types, torch\n"
            "from relaunch.components.core.trainer.setup import seed\n"
            "seed(types.SimpleNamespace(train=types.SimpleNamespace(seed=1, deterministic=True)))\n"
            "print(torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),"
            " 'torch._inductor' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=180,
                          env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin",
                               "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["True", "False", "False"]
