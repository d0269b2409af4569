"""Sharded (FSDP2) training state under real torchrun ranks (gloo, CPU): an exact resume after a kill,
resharding 2 -> 1 -> 3 ranks and DDP <-> FSDP, a damaged shard that every rank falls back from
together, and what each rank reads from S3 (its share; replicated state once per node)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from relaunch.components.core.checkpoint import step_key
from relaunch.components.core.store import open_store
from tests import warm_processes
from tests.core.helpers import assert_bitwise_equal, s3_root

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def _torchrun(nproc: int, *args: str, ok: bool = True) -> subprocess.CompletedProcess:
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node", str(nproc),
           "-m", "tests.core.fsdp_worker", *args]
    proc = warm_processes.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
                              timeout=300)
    if ok:
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def _state(path: Path) -> dict:
    return torch.load(path, weights_only=True)


def _ranks(out: Path, n: int) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)]


def test_fsdp_on_2_ranks_killed_mid_run_resumes_bitwise_equal_to_an_uninterrupted_run(tmp_path):
    store = str(tmp_path / "store")
    _torchrun(2, "--root", str(tmp_path / "straight-store"), "--out", str(tmp_path / "straight"), "--steps", "6")
    killed = _torchrun(2, "--root", store, "--out", str(tmp_path / "first"), "--steps", "6", "--save-at", "3",
                       "--crash-after", "4", ok=False)
    assert killed.returncode != 0
    _torchrun(2, "--root", store, "--out", str(tmp_path / "resumed"), "--steps", "3", "--resume")
    assert [r["loaded_step"] for r in _ranks(tmp_path / "resumed", 2)] == [3, 3]
    assert_bitwise_equal(_state(tmp_path / "straight" / "final.pt"), _state(tmp_path / "resumed" / "final.pt"))


def test_a_checkpoint_reshards_fsdp_2_to_1_to_3_ranks_and_between_ddp_and_fsdp(tmp_path):
    store = str(tmp_path / "store")
    _torchrun(2, "--root", store, "--out", str(tmp_path / "w0"), "--steps", "2", "--save-at", "2")
    chain = [(1, "fsdp"), (3, "fsdp"), (2, "ddp"), (2, "fsdp")]  # each loads what the one before saved
    saved = tmp_path / "w0" / "step2.pt"
    for i, (nproc, parallelism) in enumerate(chain, start=1):
        step = 2 + i
        out = tmp_path / f"w{i}"
        _torchrun(nproc, "--root", store, "--out", str(out), "--parallelism", parallelism, "--resume",
                  "--steps", "1", "--save-at", str(step))
        assert_bitwise_equal(_state(saved), _state(out / "loaded.pt"), f"{nproc} x {parallelism}")
        saved = out / f"step{step}.pt"


@pytest.mark.parametrize("backend", ["s3", pytest.param("azure", marks=pytest.mark.ci_lane)])  # the same on S3 in make test
def test_a_flipped_byte_in_one_ranks_shard_makes_every_rank_load_the_previous_checkpoint_and_each_rank_reads_its_share(
        tmp_path, backend, request):
    root = _remote_root(request, backend, "sharded")
    _torchrun(2, "--root", root, "--out", str(tmp_path / "w"), "--steps", "4", "--save-at", "2,4", "--width", "8192")
    _torchrun(2, "--root", root, "--out", str(tmp_path / "r"), "--resume", "--width", "8192")
    assert_bitwise_equal(_state(tmp_path / "w" / "step4.pt"), _state(tmp_path / "r" / "loaded.pt"))
    store = open_store(root)
    shards = {k: len(store.read_bytes(k)) for k in store.list(step_key(4) + "/") if k.endswith(".distcp")}
    share = sum(shards.values()) / 2
    for rank in _ranks(tmp_path / "r", 2):
        assert rank["stats"]["bytes_read"] <= 1.1 * share, (rank, share)
        assert rank["stats"].get("download", 0) == 0  # ranged reads only: no staging copy

    key = f"{step_key(4)}/__1_0.distcp"
    data = bytearray(store.read_bytes(key))
    data[len(data) // 2] ^= 0x01
    store.write_bytes(key, bytes(data))
    damaged = _torchrun(2, "--root", root, "--out", str(tmp_path / "f"), "--resume", "--width", "8192")
    assert [r["loaded_step"] for r in _ranks(tmp_path / "f", 2)] == [2, 2]
    assert "__1_0.distcp" in damaged.stderr and "loading the previous committed checkpoint" in damaged.stderr
    assert_bitwise_equal(_state(tmp_path / "w" / "step2.pt"), _state(tmp_path / "f" / "loaded.pt"))


@pytest.mark.parametrize("backend", ["s3", pytest.param("azure", marks=pytest.mark.ci_lane)])  # the same on S3 in make test
def test_replicated_ddp_state_is_read_once_per_node_from_an_object_store(tmp_path, backend, request):
    root = _remote_root(request, backend, "replicated")
    _torchrun(4, "--root", root, "--out", str(tmp_path / "w"), "--parallelism", "ddp", "--steps", "1",
              "--save-at", "1", "--width", "8192")
    _torchrun(4, "--root", root, "--out", str(tmp_path / "r"), "--parallelism", "ddp", "--resume",
              "--ranks-per-node", "2", "--width", "8192")
    store = open_store(root)
    total = sum(len(store.read_bytes(k)) for k in store.list(step_key(1) + "/") if k.endswith(".distcp"))
    read = [r["stats"]["bytes_read"] for r in _ranks(tmp_path / "r", 4)]
    for node in (read[0:2], read[2:4]):
        assert 0.9 * total <= sum(node) <= 1.1 * total, (read, total)  # once per node, not once per rank
    assert_bitwise_equal(_state(tmp_path / "w" / "step1.pt"), _state(tmp_path / "r" / "loaded.pt"))


@pytest.mark.ci_lane  # resharding: the filesystem case above in make test; a gs:// store's training: test_store_gcs_run
def test_a_checkpoint_on_gcs_reshards_fsdp_2_to_1_to_3_ranks(tmp_path, gcs_env):
    root = gcs_env.root("sharded")
    _torchrun(2, "--root", root, "--out", str(tmp_path / "w0"), "--steps", "2", "--save-at", "2")
    saved = tmp_path / "w0" / "step2.pt"
    for i, nproc in enumerate((1, 3), start=1):
        out = tmp_path / f"w{i}"
        _torchrun(nproc, "--root", root, "--out", str(out), "--resume", "--steps", "1", "--save-at", str(2 + i))
        assert_bitwise_equal(_state(saved), _state(out / "loaded.pt"), f"{nproc} ranks")
        saved = out / f"step{2 + i}.pt"


def _remote_root(request, backend: str, name: str) -> str:
    if backend == "azure":
        return request.getfixturevalue("azure_env").root(name)
    return s3_root(request.getfixturevalue("s3_env"), name)


@pytest.mark.parametrize("global_shape,mesh_shape,placements", [
    (shape, mesh, kinds) for shape in [(10, 3), (7,), (3, 5), (1, 4), (0, 2), (12, 9, 2)]
    for mesh, kinds in [((2,), "S0"), ((3,), "S0"), ((4,), "S0"), ((5,), "S0"), ((2, 2), "S0,S1"), ((2, 3), "S0,S0"),
                        ((3, 2), "R,S0")]
    if len(shape) > 1 or "S1" not in kinds
])
def test_the_load_planners_shard_chunks_follow_dtensors_own_rule(global_shape, mesh_shape, placements):
    """dcp_io.shard_chunk computes a plain-sharded DTensor's chunk itself (DTensor's own way builds a
    torch.arange per shard); it must agree with DTensor for every rank, or resharding loads go wrong."""
    import itertools

    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset  # the reference

    from relaunch.components.core.checkpoint.dcp_io import shard_chunk

    kinds = [Replicate() if p == "R" else Shard(int(p[1])) for p in placements.split(",")]
    for coordinate in itertools.product(*(range(n) for n in mesh_shape)):
        sizes, offsets = shard_chunk(global_shape, mesh_shape, list(coordinate), kinds)
        want = _compute_local_shape_and_global_offset(global_shape, mesh_shape, list(coordinate), kinds)
        assert (tuple(sizes), tuple(offsets)) == (tuple(want[0]), tuple(want[1])), coordinate
