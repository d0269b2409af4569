"""The container supervisor turns torchrun's blanket exit 1 into the contract's exit code, so the
PyTorchJob's ``restartPolicy: ExitCode`` restarts a pod after a kill and never after a bad input. A SIGTERM
passed on to the workers, exit 143: test_resume's SIGTERM during a save, which runs under the supervisor."""

from __future__ import annotations

import pytest

from relaunch.components.core.contract.exitcodes import ExitCode, is_retryable
from tests.train.conftest import SUPERVISE, start_torchrun, train_config

pytestmark = pytest.mark.slow


def _config(tmp_path, **train):
    return train_config(tmp_path, f"sqlite:///{tmp_path}/mlflow.db", **train)


def test_a_diverged_training_exits_3_through_the_supervisor_although_torchrun_says_1(tmp_path):
    # the same training under bare torchrun ends 1: test_health's non-finite loss test
    supervised = start_torchrun(_config(tmp_path, task="tests.train.tasks:nan_task"), tmp_path, prefix=SUPERVISE)
    assert supervised.wait() == ExitCode.DIVERGED


@pytest.mark.ci_lane  # a killed worker's 137 (warm): test_resume's SIGKILL test and the local run's demo
def test_a_killed_worker_gives_a_retryable_code_through_the_supervisor(tmp_path):
    config = _config(tmp_path)
    config["launch"] = {"inject_failure": "kill-worker@step=5"}
    code = start_torchrun(config, tmp_path, prefix=SUPERVISE).wait()
    # the survivor is a peer of the killed worker: the attempt ends as the killed one did
    assert code == ExitCode.KILLED and is_retryable(code)

