"""Real workloads under real faults, on a real 2-process torchrun (gloo, CPU): the language model
(components/tasks/lm.py) streamed from its committed shards by loader worker processes, and a user's own
IterableDataset read through torchdata's StatefulDataLoader; each SIGKILLed mid-epoch and resumed, bitwise
equal to its uninterrupted twin."""

from __future__ import annotations

import pytest
import torch

from tests.train.conftest import mlflow_runs, run_torchrun, train_config

pytestmark = pytest.mark.slow

TINY_LM = {"task": "relaunch.components.tasks.lm:make_task", "max_steps": 30, "checkpoint_every_steps": 10,
           "global_batch_size": 8, "grad_accum_steps": 2, "grad_clip_norm": 1.0, "lr": 0.003,
           "task_options": {"d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 32, "max_corpus_bytes": 300_000}}


def _final_state(config: dict) -> dict[str, torch.Tensor]:
    """Model and optimizer tensors of the newest committed checkpoint, loaded with the task's own model."""
    from relaunch.components.core.checkpoint import CheckpointManager
    from relaunch.components.core.contract.config import RelaunchConfig
    from relaunch.components.core.trainer.state import TrainingState
    from relaunch.components.tasks.base import load_task

    resolved = RelaunchConfig.model_validate(config)
    task = load_task(resolved.train.task, resolved)
    model = task.build_model()
    optimizer = task.build_optimizer(model)
    manager = CheckpointManager(resolved.store.uri)
    manager.load(TrainingState(model, optimizer))
    manager.close()
    out = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, state in enumerate(optimizer.state.values()):
        out.update({f"optim.{i}.{k}": v.clone() for k, v in state.items() if isinstance(v, torch.Tensor)})
    return out


def _assert_bitwise_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and len(a) >= 8
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


# FSDP2 with bf16 autocast: the same code path for the data, another for the state (the extended lane)
@pytest.mark.parametrize("parallel", ["ddp", pytest.param("fsdp", marks=pytest.mark.ci_extended)])
def test_the_language_model_killed_mid_epoch_resumes_from_its_shards_bitwise_equal(tmp_path, tracking, parallel):
    lm = {**TINY_LM, "parallelism": parallel, "amp": parallel == "fsdp"}
    plain = train_config(tmp_path / "plain", tracking, **lm)
    killed = train_config(tmp_path / "killed", tracking, **lm)
    for config in (plain, killed):
        config["data"] = {"num_workers": 2}
    killed["launch"] = {"inject_failure": "kill-worker@step=17"}

    reference = run_torchrun(plain, tmp_path, name="plain")
    restarted = run_torchrun(killed, tmp_path, name="killed", max_restarts=2)

    assert reference.proc.returncode == 0, reference.output()[-3000:]
    assert restarted.proc.returncode == 0, restarted.output()[-3000:]
    summary = restarted.records("SUMMARY")[-1]
    assert summary["attempts"] == 2 and summary["resumed_from_steps"][1] == 10, summary
    model_state = _final_state(plain)
    assert any(k.endswith("head.weight") for k in model_state)  # the tied head, as a user's model has it
    _assert_bitwise_equal(model_state, _final_state(killed))
    run = mlflow_runs(tracking, killed["tracking"]["experiment"])[0]
    assert run.info.status == "FINISHED" and {"val_loss", "val_perplexity", "val_token_accuracy"} <= set(run.data.metrics)


def test_a_users_own_iterable_dataset_resumes_exactly_after_its_loader_worker_is_sigkilled(tmp_path, tracking):
    """The kill lands inside the user's own dataset code, in a loader worker process, mid-epoch: the rank
    ends 137 (a killed worker), torchrun restarts the group, and the StatefulDataLoader state each rank
    checkpointed puts every worker back where it was."""
    own = {"task": "tests.train.tasks:own_iterable_task", "max_steps": 30, "checkpoint_every_steps": 10}
    plain = train_config(tmp_path / "plain", tracking, **own)
    killed = train_config(tmp_path / "killed", tracking, **own)
    for config in (plain, killed):
        config["data"] = {"num_workers": 2}
    marker = tmp_path / "loader-killed"

    reference = run_torchrun(plain, tmp_path, name="plain")
    # sample 1000 is among the samples of epoch 1 (steps 19-37 of 64-sample global batches)
    restarted = run_torchrun(killed, tmp_path, name="killed", max_restarts=2,
                             env={"KILL_LOADER_AT": "1000", "KILL_LOADER_MARKER": str(marker)})

    assert reference.proc.returncode == 0, reference.output()[-3000:]
    assert restarted.proc.returncode == 0, restarted.output()[-3000:]
    assert marker.exists(), "the loader worker was never killed"
    summary = restarted.records("SUMMARY")[-1]
    assert summary["attempts"] == 2, summary
    assert "data-loader worker process" in restarted.output() and "died" in restarted.output()
    _assert_bitwise_equal(_final_state(plain), _final_state(killed))
