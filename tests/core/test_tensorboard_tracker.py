"""TensorBoard as a second tracker (components/core/tracking/tensorboard_tracker.py): what it wrote across a
killed attempt and its resumed one, read back with TensorBoard's own loader (``EventAccumulator``)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from relaunch.components.core.contract.config import RelaunchConfig
from relaunch.components.core.contract.errors import BadInput
from relaunch.components.core.tracking.tensorboard_tracker import TensorBoardTracker
from relaunch.components.core.tracking.trackers import AttemptStart, open_trackers
from tests.needs import needed

KILLED_ATTEMPT = textwrap.dedent("""
    import os, signal, sys
    from relaunch.components.core.tracking.tensorboard_tracker import TensorBoardTracker
    from relaunch.components.core.tracking.trackers import AttemptStart

    board = TensorBoardTracker(sys.argv[1])
    board.start(AttemptStart(attempt=1, resumed_from=-1, resumed_uri=None, world_size=2))
    for step in range(1, 15):
        board.log_metrics({"train/loss": 1.0 / step, "train/lr": 0.05}, step)
        if step == 10:
            board.before_checkpoint(step)
    os.kill(os.getpid(), signal.SIGKILL)  # rank 0 lost after its checkpoint of step 10
""")


def _start(board: TensorBoardTracker, attempt: int, resumed_from: int) -> None:
    board.start(AttemptStart(attempt=attempt, resumed_from=resumed_from, resumed_uri=None, world_size=2))


@pytest.mark.parametrize("resumed_from", [10, -1], ids=["its-checkpoint-committed", "no-checkpoint-committed"])
def test_a_rank_0_killed_after_a_checkpoint_keeps_every_point_up_to_it_and_its_resumed_attempt_the_rest(
        tmp_path, resumed_from):
    needed("tensorboard", "the TensorBoard tracker's tests need the test extra: pip install -e '.[test]'")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folder = tmp_path / "tb"
    killed = subprocess.run([sys.executable, "-c", KILLED_ATTEMPT, str(folder)])
    assert killed.returncode == -9
    # TensorBoard reads a folder's event files in the order of their names, which begin with the second the
    # writer opened (then host, pid): a real restart opens its file seconds after the killed attempt's
    time.sleep(1.0 - time.time() % 1.0 + 0.01)
    board = TensorBoardTracker(str(folder))
    _start(board, 2, resumed_from)
    for step in range(max(resumed_from, 0) + 1, 21):  # the resumed attempt's values differ, so whose point is shown is known
        board.log_metrics({"train/loss": 2.0 / step, "train/lr": 0.05}, step)
    board.close(5.0)

    events = EventAccumulator(str(folder))
    events.Reload()
    loss = [(event.step, event.value) for event in events.Scalars("train/loss")]
    assert [step for step, _ in loss] == list(range(1, 21)), "every step once, in order"
    assert all(value == pytest.approx((1.0 if step <= resumed_from else 2.0) / step) for step, value in loss), \
        "steps up to the checkpoint resumed from are the killed attempt's, the rest the resumed one's"


def test_tensorboard_is_opened_only_when_its_folder_is_set(tmp_path):
    assert not any(isinstance(t, TensorBoardTracker) for t in open_trackers(RelaunchConfig(), None, run_id="r", attempt=1))
    config = RelaunchConfig.model_validate({"tracking": {"tensorboard_dir": str(tmp_path / "tb")}})
    assert any(isinstance(t, TensorBoardTracker) for t in open_trackers(config, None, run_id="r", attempt=1))


def test_a_missing_tensorboard_package_is_bad_input_naming_the_fix(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # what an environment without it raises
    with pytest.raises(BadInput, match="tracking.tensorboard_dir is set but the tensorboard package is not installed"):
        _start(TensorBoardTracker(str(tmp_path / "tb")), 1, -1)
