"""A tensor item's archive, built by relaunch's writer without torch.save (issue 42: torch.save costs ~0.4
ms a tensor), is byte for byte what torch.save writes; a dtype torch.save writes another way goes
through torch.save itself; a checkpoint of thousands of small tensors of every kind reads back through
relaunch and through stock DCP, its chunks tiling each file."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from relaunch.components.core.checkpoint import CheckpointManager, step_key
from relaunch.components.core.checkpoint import dcp_io, verify
from relaunch.components.core.store import open_store

SHAPES = [(), (1,), (7,), (300,), (70000,), (3, 5), (1, 1), (2, 3, 4), (2, 1, 3, 1), (2, 2, 2, 2, 2), (70000, 3)]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128]


def _random(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype if dtype not in (torch.float16, torch.bfloat16)
                           else torch.float32).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_archive_built_for_a_tensor_is_byte_for_byte_what_torch_save_writes(dtype):
    maker = dcp_io.archive_maker(dtype)
    assert maker is not None, f"torch {torch.__version__} writes {dtype} archives another way"
    g = torch.Generator().manual_seed(1)
    for shape in SHAPES:
        tensor = _random(shape, dtype, g)
        saved = io.BytesIO()
        torch.save(tensor, saved)
        built = maker.archive(tensor)
        assert built == saved.getvalue(), (dtype, shape)
        back = torch.load(io.BytesIO(built), weights_only=True)
        assert back.dtype == dtype and back.shape == tensor.shape and torch.equal(back, tensor)


def test_a_dtype_that_torch_save_pickles_another_way_gets_no_archive_maker():
    # float8 and uint16 storages are pickled untyped with _rebuild_tensor_v3: the probes differ
    assert dcp_io.archive_maker(torch.float8_e4m3fn) is None
    assert dcp_io.archive_maker(torch.uint16) is None


def _many(count: int) -> dict:
    """``count`` small tensors of every kind (dtypes built here and by torch.save, empty, 0-d, views,
    transposed), one large one written from its own memory, and non-tensor values."""
    g = torch.Generator().manual_seed(count)
    kinds = [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.float8_e4m3fn, torch.uint16]
    small = {}
    for i in range(count):
        dtype = kinds[i % len(kinds)]
        shape = [(), (5,), (3, 7), (0, 2), (4, 1, 2)][i % 5]
        small[f"t{i}"] = _random(shape, torch.float32 if dtype in (torch.float8_e4m3fn, torch.uint16) else dtype,
                                 g).to(dtype)
    base = torch.randn(40, 30, generator=g)
    return {"small": small, "large": torch.randn(300_000, generator=g), "view": base[3:9], "transposed": base.t(),
            "step": 11, "note": "x"}


def _equal(a, b, path: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)), path
    elif isinstance(a, dict):
        assert set(a) == set(b), path
        for k in a:
            _equal(a[k], b[k], f"{path}.{k}")
    else:
        assert a == b, path


def _zeros(value):
    if isinstance(value, torch.Tensor):
        return torch.zeros_like(value.contiguous())
    if isinstance(value, dict):
        return {k: _zeros(v) for k, v in value.items()}
    return value


def test_thousands_of_small_tensors_of_every_kind_read_back_through_relaunch_and_stock_dcp(tmp_path, monkeypatch):
    monkeypatch.setattr(verify, "CHUNK_BYTES", 64 * 1024)  # many chunks, each across several items
    root = str(tmp_path / "store")
    state = _many(3000)
    with CheckpointManager(root, owner="archives", async_save=False) as mgr:
        mgr.save(1, state)
    with CheckpointManager(root, owner="archives") as mgr:
        loaded = _zeros(state)
        mgr.load(loaded)
        mgr.verify(1, deep=True)
    _equal(state, loaded, "relaunch")
    stock = _zeros(state)
    dcp.load(stock, storage_reader=FileSystemReader(str(Path(root) / step_key(1))))
    _equal(state, stock, "dcp.load")


def test_the_chunks_tile_each_data_file_each_large_payload_in_chunks_of_its_own(tmp_path, monkeypatch):
    monkeypatch.setattr(verify, "CHUNK_BYTES", 100_000)
    root = str(tmp_path / "store")
    with CheckpointManager(root, owner="archives", async_save=False) as mgr:
        mgr.save(1, _many(200))
    key = step_key(1)
    manifest = json.loads(open_store(root).read_bytes(f"{key}/MANIFEST.json"))
    metadata = dcp.FileSystemReader(str(Path(root) / key)).read_metadata()
    items = {(info.relative_path, info.offset): info.length for info in metadata.storage_data.values()}
    small = min(dcp_io.SMALL_CHUNK_BYTES, 100_000)
    for name, meta in manifest["files"].items():
        if name == ".metadata":
            continue
        size = (Path(root) / key / name).stat().st_size
        chunks = meta["chunks"]
        assert meta["size"] == size and chunks[0][0] == 0
        assert all(a[0] + a[1] == b[0] for a, b in zip(chunks, chunks[1:])) and chunks[-1][0] + chunks[-1][1] == size
        starts = {c[0]: c[1] for c in chunks}
        large = []
        for item, payload in meta["payloads"]:
            assert item < payload < item + items[(name, item)]
            assert (payload - item) % 64 == 0  # torch aligns a record's data to 64 bytes
            if items[(name, item)] > dcp_io.DIRECT_BYTES + 4096:  # the large tensor: chunks from its payload on
                assert starts.get(payload) == 100_000
                large.append((payload, item + items[(name, item)]))
        assert large or name != "__0_0.distcp"
        for offset, length, _ in chunks:  # the rest: the small pieces, in chunks of at most SMALL_CHUNK_BYTES
            assert length <= small or any(lo <= offset and offset + length <= hi for lo, hi in large)
