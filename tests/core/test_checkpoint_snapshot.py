"""An async save with ``defer_copy`` copies the parameters and optimizer state in the background while
the next step's forward and backward run; the optimizer's step, or ``wait_for_snapshot()``, holds back
what changes them, and the committed checkpoint holds the state of the step it was saved at."""

from __future__ import annotations

import pytest
import torch

from relaunch.components.core.checkpoint import CheckpointManager
from relaunch.components.core.trainer.state import TrainingState


CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"))


def _state(seed: int, width: int, batch_norm: bool = False, device: str = "cpu") -> TrainingState:
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(width, width), torch.nn.Linear(width, width)]
    if batch_norm:
        layers.insert(1, torch.nn.BatchNorm1d(width))
    model = torch.nn.Sequential(*layers).to(device)
    return TrainingState(model, torch.optim.AdamW(model.parameters(), lr=0.01))


def _step(state: TrainingState, width: int) -> None:
    device = next(state.model.parameters()).device
    state.model(torch.randn(8, width, device=device)).pow(2).mean().backward()
    state.optimizer.step()
    state.optimizer.zero_grad()
    state.step += 1


def _tensors(state: TrainingState) -> list[torch.Tensor]:
    """Parameters, buffers and optimizer state, in a fixed order."""
    out = [t.detach() for t in state.model.state_dict().values()]
    for param_state in state.optimizer.state.values():
        out += [v for v in param_state.values() if isinstance(v, torch.Tensor)]
    return out


def _loaded(root, width: int, batch_norm: bool = False, device: str = "cpu") -> TrainingState:
    fresh = _state(seed=99, width=width, batch_norm=batch_norm, device=device)
    _step(fresh, width)  # the optimizer state exists, with other values
    with CheckpointManager(root, owner="snapshot-test") as mgr:
        mgr.load(fresh)
    return fresh


def _assert_step_1_holds(root, saved: list, width: int, **kw) -> None:
    loaded = _loaded(root, width, **kw)
    assert loaded.step == 1
    for before, got in zip(saved, _tensors(loaded), strict=True):
        assert torch.equal(before, got)


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_state_changed_in_place_right_after_wait_for_snapshot_is_not_in_the_checkpoint(tmp_path, device):
    # 2048 x 2048 layers: ~100 MB of parameters and AdamW moments, so that the background copy is
    # still running when save() returns (without the wait, the in-place change below lands in it)
    width = 2048
    state = _state(seed=1, width=width, device=device)
    _step(state, width)
    saved = [t.clone() for t in _tensors(state)]
    mgr = CheckpointManager(str(tmp_path / "store"), owner="snapshot-test")
    mgr.save(1, state, defer_copy=True)
    mgr.wait_for_snapshot()
    for t in reversed(_tensors(state)):  # the tensors copied last are changed first
        t.add_(1.0)
    mgr.close()

    changed = _tensors(state)
    assert not any(torch.equal(a, b) for a, b in zip(saved, changed))
    _assert_step_1_holds(str(tmp_path / "store"), saved, width, device=device)


def test_buffers_and_counters_a_forward_changes_are_taken_in_save_itself(tmp_path):
    width = 16
    state = _state(seed=2, width=width, batch_norm=True)
    _step(state, width)
    saved = [t.clone() for t in _tensors(state)]
    running_mean = state.model[1].running_mean.clone()
    mgr = CheckpointManager(str(tmp_path / "store"), owner="snapshot-test")
    mgr.save(1, state, defer_copy=True)
    state.model(torch.randn(8, width) + 5.0).sum().backward()  # BatchNorm updates its running stats
    state.step += 1
    mgr.wait_for_snapshot()
    mgr.close()

    assert not torch.equal(state.model[1].running_mean, running_mean)  # the forward did change it
    _assert_step_1_holds(str(tmp_path / "store"), saved, width, batch_norm=True)


def test_a_deferred_copy_is_finished_before_the_next_save_or_a_load(tmp_path):
    width = 64
    state = _state(seed=3, width=width)
    root = str(tmp_path / "store")
    mgr = CheckpointManager(root, owner="snapshot-test", keep_last=0)
    _step(state, width)
    mgr.save(1, state, defer_copy=True)
    first = [t.clone() for t in _tensors(state)]
    mgr.save(2, state, defer_copy=True)  # the same state saved again: waits for the first job
    mgr.wait_for_snapshot()
    _step(state, width)
    mgr.load(state, step=1)  # waits for the second save, then reads the first
    for before, got in zip(first, _tensors(state), strict=True):
        assert torch.equal(before, got)
    mgr.close()


def test_with_a_deferred_copy_the_optimizers_next_step_waits_for_it_by_itself(tmp_path):
    width = 2048  # ~100 MB of parameters and moments: the copy still runs when save() returns
    state = _state(seed=6, width=width)
    _step(state, width)
    saved = [t.clone() for t in _tensors(state)]
    mgr = CheckpointManager(str(tmp_path / "store"), owner="snapshot-test")
    mgr.save(1, state, defer_copy=True)  # no wait_for_snapshot() below: the step must wait by itself
    _step(state, width)
    mgr.close()

    assert not any(torch.equal(a, b) for a, b in zip(saved, _tensors(state)))
    _assert_step_1_holds(str(tmp_path / "store"), saved, width)


def test_a_second_save_reuses_the_staging_buffers_and_holds_the_second_state_bitwise(tmp_path):
    from relaunch.components.core.checkpoint.snapshot import Snapshotter

    width = 512  # 1 MiB layers: several chunks of the parallel copy in all
    state = _state(seed=4, width=width)
    _step(state, width)
    root = str(tmp_path / "store")
    mgr = CheckpointManager(root, owner="snapshot-test", keep_last=0)  # the default: async, copy in save()
    mgr.save(1, state)
    first = [t.clone() for t in _tensors(state)]
    mgr.wait()
    _step(state, width)  # every parameter and moment changes in place
    mgr.save(2, state)
    second = [t.clone() for t in _tensors(state)]
    _step(state, width)  # changed after save() returned: not in checkpoint 2
    mgr.close()
    for step, expected in ((1, first), (2, second)):
        fresh = _state(seed=99, width=width)
        _step(fresh, width)
        with CheckpointManager(root, owner="snapshot-test") as reader:
            reader.load(fresh, step=step)
        for before, got in zip(expected, _tensors(fresh), strict=True):
            assert torch.equal(before, got)

    snapshots = Snapshotter()
    taken = snapshots.take(state)
    pointers = [t.data_ptr() for t in taken["model"].values()]
    _step(state, width)
    again = snapshots.take(state)
    assert [t.data_ptr() for t in again["model"].values()] == pointers  # the same buffers, refilled
    for live, copied in zip(state.model.state_dict().values(), again["model"].values(), strict=True):
        assert torch.equal(live, copied)


def test_a_snapshot_copied_in_chunks_by_several_threads_is_bitwise_for_every_kind_of_tensor():
    from relaunch.components.core.checkpoint.snapshot import COPY_CHUNK, Snapshotter

    g = torch.Generator().manual_seed(5)
    state = {"extra": {
        "bytes": torch.randint(0, 256, (3 * COPY_CHUNK + 13,), dtype=torch.uint8, generator=g),  # ragged last chunk
        "bf16": torch.randn(COPY_CHUNK // 2 + 7, generator=g).to(torch.bfloat16),
        "transposed": torch.randn(300, 200, generator=g).t(),  # not contiguous: copied as it is
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(3.5),
        "count": 7,
    }}
    snapshots = Snapshotter()
    for _ in range(2):  # allocating, then reusing
        taken = snapshots.take(state)
        for name, live in state["extra"].items():
            if isinstance(live, torch.Tensor):
                assert taken["extra"][name].dtype == live.dtype and torch.equal(taken["extra"][name], live)
        assert taken["extra"]["count"] == 7
        state["extra"]["bytes"].add_(1)
        state["extra"]["bf16"].mul_(2)


def test_a_process_that_took_a_snapshot_winds_down_without_waiting_on_a_copy_thread():
    # a warm child ends with wind_down(), which joins every non-daemon thread: an idle copy helper
    # that is not a daemon (a ThreadPoolExecutor's worker) would hold the process forever
    import subprocess
    import sys
    from pathlib import Path

    script = (
        "import torch\n"
        "from relaunch.components.core.checkpoint.snapshot import COPY_CHUNK, Snapshotter\n"
        "from relaunch.components.core.runtime.stepcli import wind_down\n"
        "state = {'x': torch.randn(COPY_CHUNK)}\n"
        "assert torch.equal(Snapshotter().take(state)['x'], state['x'])\n"
        "wind_down()\n"
        "print('wound down')\n"
    )
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", script], cwd=root, env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "wound down" in proc.stdout, proc.stderr[-2000:]
