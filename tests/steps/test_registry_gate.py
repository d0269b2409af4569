"""The registry never sees a training that did not reach its end: launch says whether it completed,
evaluate reads that (the spec wires it), and an incomplete training is neither evaluated nor passes."""

from __future__ import annotations

import json

import pytest
import torch

from relaunch.pipelines.spec import EVALUATE, LAUNCH, PIPELINE, REGISTER, output
from relaunch.components.core.checkpoint import CheckpointManager
from relaunch.components.core.contract.config import RelaunchConfig
from relaunch.components.core.trainer.state import TrainingState
from relaunch.components import evaluate
from relaunch.components.core.store.ledger import completed
from relaunch.components.tasks.base import load_task


@pytest.fixture
def config(tmp_path) -> RelaunchConfig:
    config = RelaunchConfig.model_validate({"store": {"uri": str(tmp_path / "store")}, "train": {"hidden_size": 8},
                                            "evaluate": {"gate_min": 0.0}})
    mgr = CheckpointManager(config.store.uri, async_save=False)
    torch.manual_seed(0)
    mgr.save(83, TrainingState(load_task(config.train.task, config).build_model()), metrics={"val_loss": 1.0})
    return config


@pytest.mark.parametrize("summary, done", [
    ({"exit_code": 0, "last_step": 76, "total_steps": 76}, True),
    ({"exit_code": 0, "last_step": 83, "total_steps": 76}, False),  # another training's checkpoint
    ({"exit_code": 0, "last_step": 40, "total_steps": 76}, False),
    ({"exit_code": 143, "last_step": 76, "total_steps": 76}, False),
    ({}, False),
])
def test_launch_calls_a_training_complete_only_at_exactly_its_last_step(summary, done):
    written = {"reason": "", "run_id": "run-a", "attempt": 1, **summary} if summary else summary
    assert completed(written) is done


def test_the_spec_feeds_launchs_verdict_to_evaluate_whose_verdict_gates_register():
    assert any(i.source == output(LAUNCH, "completed") for i in EVALUATE.inputs)
    assert REGISTER.when.source == output(EVALUATE, "passed") and PIPELINE.step(EVALUATE.name) is EVALUATE


@pytest.mark.parametrize("verdict", [False, "false"])
def test_an_incomplete_training_is_not_evaluated_and_fails_the_gate(config, verdict):
    out = evaluate.run(config, training_completed=verdict)
    assert out.passed is False and json.loads(out.metrics_json) == {} and out.checkpoint_uri == ""


def test_a_completed_training_is_evaluated_and_its_gate_decides(config):
    out = evaluate.run(config, training_completed="true")
    assert out.step == 83 and out.passed is True
