"""One process builds the task once: checking the inputs loads the task and checks
``train.resume_from`` against the model that same task builds. Counted by a real task factory
(tests/tasks/counting.py)."""

from __future__ import annotations

from relaunch.components import prepare
from relaunch.components.core.checkpoint import CheckpointManager
from relaunch.components.core.contract.config import RelaunchConfig
from relaunch.components.core.trainer.state import TrainingState
from tests.tasks import counting


def test_checking_the_inputs_with_resume_from_builds_the_task_once(tmp_path):
    spec = "tests.tasks.counting:make_task"
    base = {"store": {"uri": str(tmp_path / "store")}, "tracking": {"uri": f"sqlite:///{tmp_path / 'mlflow.db'}"}}
    writer = RelaunchConfig.model_validate({**base, "train": {"task": spec, "hidden_size": 8}})
    with CheckpointManager(writer.store.uri, async_save=False) as mgr:
        mgr.save(4, TrainingState(counting.make_task(writer).build_model()))
        resume_from = mgr.latest().uri
    config = RelaunchConfig.model_validate({**base, "train": {"task": spec, "hidden_size": 8,
                                                              "resume_from": resume_from}})
    counting.built = 0
    prepare.check_inputs(config)
    assert counting.built == 1
