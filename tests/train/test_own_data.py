"""The README's three ways to hand relaunch your own data (docs/examples/own_data.py: a map-style
Dataset, an IterableDataset, a stateful loader of your own), each trained by a real 2-process torchrun,
preempted mid-epoch and resumed: its final state bitwise equal to an uninterrupted run's."""

from __future__ import annotations

import pytest

from tests.train.conftest import run_torchrun, train_config
from tests.train.test_streamed_data import _assert_bitwise_equal, _final_state

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("task", [
    "map_style_task",
    pytest.param("iterable_task", marks=pytest.mark.ci_lane),  # the same IterableDataset, its loader worker SIGKILLed: test_streamed_data
    "stateful_loader_task"])
def test_a_tasks_own_data_is_preempted_mid_epoch_and_resumes_bitwise_equal(tmp_path, tracking, task):
    own = {"task": f"docs.examples.own_data:{task}", "max_steps": 30, "checkpoint_every_steps": 10}
    plain = train_config(tmp_path / "plain", tracking, **own)
    stopped = train_config(tmp_path / "stopped", tracking, **own)
    for config in (plain, stopped):
        config["data"] = {"num_workers": 2}

    reference = run_torchrun(plain, tmp_path, name="plain")
    assert reference.proc.returncode == 0, reference.output()[-3000:]
    stopped["launch"] = {"inject_failure": "preempt@step=13"}  # mid-epoch: 19 steps of 64 samples an epoch
    first = run_torchrun(stopped, tmp_path, name="first")
    assert first.records("SUMMARY")[-1]["exit_code"] == 143, first.output()[-3000:]
    stopped["launch"] = {}
    second = run_torchrun(stopped, tmp_path, name="second")
    assert second.proc.returncode == 0, second.output()[-3000:]
    assert second.records("RESUMED")[0]["step"] == 14
    _assert_bitwise_equal(_final_state(plain), _final_state(stopped))
