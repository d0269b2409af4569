"""``relaunch checkpoints import`` of a stock ``dcp.save`` of the default task's ``{"model", "optimizer"}``:
the checkpoint it commits is one a training resumes from (its progress at ``--step``, its schedule and
counters, as the task's training builds them), and a model that does not fit the training is refused
in one line, exit 2, the store unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from relaunch.pipelines.cli import main
from tests.cli import RUN_TIMEOUT, TINY, relaunch_run

TINY_SETS = [TINY[i + 1] for i in range(0, len(TINY), 2)]  # hidden_size 32: the model the import builds too


def _stock_folder(path: Path, *overrides: str) -> dict:
    """A stock ``dcp.save`` of the default task's model and Adam state after one step (what a user of
    plain torch saves: ``get_state_dict``), written to ``path``; the model's state dict."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from relaunch.components.core.contract.config_loading import load_config
    from relaunch.components.tasks.base import load_task

    config = load_config(None, [*TINY_SETS, *overrides])
    task = load_task(config.train.task, config)
    model = task.build_model()
    optimizer = task.build_optimizer(model)
    torch.manual_seed(3)
    sum((p * torch.randn_like(p)).sum() for p in model.parameters()).backward()
    optimizer.step()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(path), no_dist=True)
    return {k: v.clone() for k, v in model.state_dict().items()}


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_an_imported_stock_model_and_optimizer_loads_into_the_tasks_training_state_at_its_step(tmp_path, capsys):
    from relaunch.components.core.checkpoint import CheckpointManager
    from relaunch.components.core.contract.config_loading import load_config
    from relaunch.components.core.data import step_counts
    from relaunch.components.core.trainer import setup
    from relaunch.components.core.trainer.health import SpikeDetector
    from relaunch.components.tasks.base import load_task

    weights = _stock_folder(tmp_path / "stock")
    root = str(tmp_path / "store")
    assert main(["checkpoints", "import", str(tmp_path / "stock"), "--store", root, "--step", "12",
                 "--set", "train.hidden_size=32", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 12
    config = load_config(None, TINY_SETS)
    task = load_task(config.train.task, config)
    steps_per_epoch, total_steps = step_counts(config, task)
    parts = setup.build_model(config, task, torch.device("cpu"), total_steps, SpikeDetector(3.0))
    with CheckpointManager(root, async_save=False) as mgr:
        info = mgr.load(parts.state)  # what the trainer's resume does: refused before the import made it whole
    assert info.step == 12 and parts.state.step == 12 and parts.state.epoch == 12 // steps_per_epoch
    for key, value in weights.items():
        assert torch.equal(parts.module.state_dict()[key], value), key
    assert parts.scheduler.last_epoch == 12  # the schedule where an uninterrupted training has it at step 12
    assert parts.optimizer.state  # Adam's moments came along


def test_importing_a_model_that_does_not_fit_the_training_exits_2_in_one_line_and_changes_nothing(tmp_path, capsys):
    from relaunch.components.core.checkpoint import CheckpointManager
    from tests.core.helpers import make_state

    root = tmp_path / "store"
    with CheckpointManager(str(root), owner="interop", async_save=False) as mgr:
        mgr.save(10, make_state(seed=1))
    _stock_folder(tmp_path / "stock", "train.hidden_size=64")
    before = _tree(root)
    capsys.readouterr()
    code = main(["checkpoints", "import", str(tmp_path / "stock"), "--store", str(root), "--set", "train.hidden_size=32"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "does not fit the model and optimizer" in err and len(err.splitlines()) == 1, err
    assert "--config/--set" in err, err
    assert _tree(root) == before


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT + 60)
def test_a_training_resumes_from_an_imported_stock_dcp_save_of_the_default_model_and_optimizer(tmp_path):
    from relaunch.components.core.store import open_store
    from relaunch.components.core.store.ledger import load_attempts
    from tests.cli import newest_training

    _stock_folder(tmp_path / "stock")
    imports = tmp_path / "imported"
    assert main(["checkpoints", "import", str(tmp_path / "stock"), "--store", str(imports), "--step", "12",
                 "--set", "train.hidden_size=32"]) == 0
    uri = f"{imports}/checkpoints/step-{12:012d}"
    out = relaunch_run(tmp_path, "--set", "train.max_steps=20", "--set", f"train.resume_from={uri}")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    attempts = load_attempts(open_store(newest_training(str(tmp_path / ".relaunch/store"))))
    assert attempts[0].resumed_from_step == 12, attempts
    assert attempts[-1].last_step == 20
