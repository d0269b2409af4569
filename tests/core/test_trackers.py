"""The tracker seam: a tracker is one class and one ``register_tracker`` line, and then the training's
tracking object feeds it the run's params, metrics, checkpoint URIs and the attempt's end, beside
MLflow (components/core/tracking/trackers.py, components/core/trainer/tracking.py)."""

from __future__ import annotations

import pytest

from relaunch.components.core.checkpoint import CheckpointInfo, step_key
from relaunch.components.core.contract.config import RelaunchConfig
from relaunch.components.core.contract.errors import BadInput
from relaunch.components.core.store import open_store
from relaunch.components.core.tracking.trackers import TRACKERS, AttemptEnd, AttemptStart, Tracker, TrackerBase, register_tracker

pytestmark = pytest.mark.slow


class ToyTracker(TrackerBase):
    """A tracker written outside the tracking package: it keeps what it is told."""

    opened: list["ToyTracker"] = []

    def __init__(self, run_id: str | None, attempt: int):
        self.run_id, self.attempt = run_id, attempt
        self.calls: list[tuple] = []
        self.opened.append(self)

    def start(self, start: AttemptStart) -> None:
        self.calls.append(("start", start.resumed_from, start.world_size))

    def log_params(self, params):
        self.calls.append(("params", dict(params)))

    def log_metrics(self, metrics, step):
        self.calls.append(("metrics", step, dict(metrics)))

    def checkpoint_committed(self, step, uri, key):
        self.calls.append(("checkpoint", step, uri))

    def end_attempt(self, end: AttemptEnd):
        self.calls.append(("end", end.exit_code, end.status))

    def close(self, timeout):
        self.calls.append(("close",))


def open_toy(config, store, *, run_id, attempt):
    return ToyTracker(run_id, attempt)


@pytest.fixture
def toy_tracker():
    ToyTracker.opened.clear()
    register_tracker("toy", open_toy)
    yield
    del TRACKERS["toy"]


def _info(store, step: int) -> CheckpointInfo:
    return CheckpointInfo(step=step, uri=store.uri_for(step_key(step)), key=step_key(step), epoch=0, world_size=1,
                          created_at="", metrics={}, manifest_sha256="")


def test_a_registered_toy_tracker_is_fed_params_metrics_checkpoints_and_the_end_beside_mlflow(
        toy_tracker, mlflow_server, tmp_path):
    from mlflow.tracking import MlflowClient

    from relaunch.components.core.tracking.client import ensure_run
    from relaunch.components.core.trainer.tracking import TrainingTracker

    config = RelaunchConfig.model_validate({"tracking": {"uri": mlflow_server.uri, "experiment": "toy-tracker"}})
    run_id = ensure_run(config, pipeline_run_id="toy-1")
    store = open_store(str(tmp_path))
    tracker = TrainingTracker(config, store, enabled=True, run_id=run_id, attempt=1)
    assert [type(t).__name__ for t in tracker.trackers] == ["MlflowTracker", "ToyTracker"]
    assert all(isinstance(t, Tracker) for t in tracker.trackers)
    tracker.start(resumed_from=-1, resumed_uri=None, params={"train.lr": 0.1}, world_size=2)
    for step in (1, 2):
        tracker.step_done(step)
        tracker.log_step(step, {"train/loss": 1.0 / step}, {"train/epoch": 0.0}, total_steps=2, epoch=0, spike=False)
    tracker.log_evaluation(2, {"val/loss": 0.4}, before_checkpoint=True)
    store.write_bytes(f"{step_key(2)}/MANIFEST.json", b"{}")
    tracker.checkpoint_committed(_info(store, 2))
    tracker.fail(BadInput("a wrong setting"), status="FAILED", told_to_go=False)  # closes within 15 s
    toy = ToyTracker.opened[-1]
    assert (toy.run_id, toy.attempt) == (run_id, 1)
    assert toy.calls == [("start", -1, 2), ("params", {"train.lr": 0.1}),
                         ("metrics", 1, {"train/loss": 1.0, "train/epoch": 0.0}), ("metrics", 2, {"train/loss": 0.5}),
                         ("metrics", 2, {"val/loss": 0.4}), ("checkpoint", 2, store.uri_for(step_key(2))),
                         ("end", 2, "FAILED"), ("close",)]
    run = MlflowClient(mlflow_server.uri).get_run(run_id)
    assert run.data.params == {"train.lr": "0.1"} and run.data.tags["checkpoint.latest"] == store.uri_for(step_key(2))
    assert run.data.metrics["val/loss"] == 0.4 and run.data.tags["relaunch.last_exit_code"] == "2"
    assert run.info.status == "FAILED"


def test_steps_computed_again_after_a_recovery_in_place_reach_no_tracker_twice(toy_tracker, mlflow_server, tmp_path):
    from relaunch.components.core.tracking.client import ensure_run
    from relaunch.components.core.trainer.tracking import TrainingTracker

    config = RelaunchConfig.model_validate({"tracking": {"uri": mlflow_server.uri, "experiment": "toy-tracker"}})
    store = open_store(str(tmp_path))
    tracker = TrainingTracker(config, store, enabled=True, run_id=ensure_run(config, pipeline_run_id="toy-2"), attempt=1)
    tracker.start(resumed_from=-1, resumed_uri=None, params={}, world_size=2)

    def steps(*numbers):
        for step in numbers:
            tracker.log_step(step, {"train/loss": 1.0 / step}, {}, total_steps=5, epoch=0, spike=False)
            if step == 4:
                tracker.log_evaluation(step, {"val/loss": 0.4}, before_checkpoint=False)

    steps(1, 2, 3, 4)
    steps(3, 4, 5)  # a peer was lost in step 5: the survivors resumed in place from their snapshot of step 2
    tracker.close(5.0)
    logged = [(call[1], sorted(call[2])) for call in ToyTracker.opened[-1].calls if call[0] == "metrics"]
    assert logged == [(1, ["train/loss"]), (2, ["train/loss"]), (3, ["train/loss"]), (4, ["train/loss"]),
                      (4, ["val/loss"]), (5, ["train/loss"])]


def test_off_rank_0_no_tracker_is_opened(toy_tracker):
    from relaunch.components.core.trainer.tracking import TrainingTracker

    tracker = TrainingTracker(RelaunchConfig(), None, enabled=False, run_id=None, attempt=1)
    tracker.start(resumed_from=-1, resumed_uri=None, params={"a": 1}, world_size=2)
    assert tracker.trackers == [] and ToyTracker.opened == []

