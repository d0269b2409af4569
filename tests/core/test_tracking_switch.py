"""The run logger and the pending-metrics record against a real ``mlflow server`` behind a switch
(:mod:`tests.tracking_switch`) whose API answers 500 while its ``/health`` answers 200: what it says, how
long it waits, and that every point reaches the run once the API answers again."""

from __future__ import annotations

import re
import threading

import pytest
from mlflow.tracking import MlflowClient

from relaunch.components.core.contract.config import RelaunchConfig
from relaunch.components.core.store import open_store, records
from relaunch.components.core.tracking.client import ensure_run
from relaunch.components.core.tracking.runlogger import RunLogger
from tests.tracking_switch import TrackingSwitch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture
def switch(mlflow_server):
    switch = TrackingSwitch(mlflow_server.uri).start()
    yield switch
    switch.stop()


def _run(uri: str, name: str) -> tuple[RelaunchConfig, str]:
    config = RelaunchConfig.model_validate({"tracking": {"uri": uri, "experiment": name}})
    return config, ensure_run(config)


def _said(lines: list[str], seen: threading.Event):
    def announce(line: str) -> None:
        lines.append(line)
        seen.set()
    return announce


def test_a_logger_whose_api_answers_500_says_lost_and_back_with_the_points_buffered_and_sends_them_all(
        switch, mlflow_server):
    _, run_id = _run(mlflow_server.uri, "switch-logger")
    lines: list[str] = []
    lost = threading.Event()
    logger = RunLogger(switch.uri, run_id, flush_seconds=0.1, announce=_said(lines, lost))
    switch.off()
    for step in range(1, 31):
        logger.log_metrics({"train/loss": 1.0 / step, "train/lr": 0.1}, step)
    assert lost.wait(60), "the logger never said it lost contact"
    for step in range(31, 41):  # logged while the API answers 500
        logger.log_metrics({"train/loss": 1.0 / step, "train/lr": 0.1}, step)
    switch.on()
    assert logger.close(120)

    assert len(lines) == 2, lines
    assert switch.uri in lines[0] and "lost contact with the tracking server" in lines[0]
    back = re.search(r"back after [\d.]+s; sending the (\d+) metric points buffered meanwhile", lines[1])
    assert back and int(back.group(1)) == 80, lines[1]  # 40 steps of 2 points, none sent before
    run = MlflowClient(mlflow_server.uri).get_run(run_id)
    steps = sorted(m.step for m in MlflowClient(mlflow_server.uri).get_metric_history(run_id, "train/loss"))
    assert steps == list(range(1, 41))
    assert run.data.tags["relaunch.tracking.lost_contact"] == "true"
    assert run.data.tags["relaunch.tracking.lost_contact_events"] == "1"


def test_a_flush_stops_waiting_for_a_server_lost_for_a_while_and_says_what_is_still_buffered(switch, mlflow_server):
    _, run_id = _run(mlflow_server.uri, "switch-flush")
    logger = RunLogger(switch.uri, run_id, flush_seconds=0.1, announce=lambda line: None)
    switch.off()
    logger.log_metrics({"train/loss": 1.0}, 1)
    assert not logger.flush(timeout=3600)  # the test's timeout, not this one, ends a flush that waits on
    assert logger.buffered_points() == 1 and not logger.connected
    assert logger.lost_contact_tags()["relaunch.tracking.lost_contact"] == "true"
    logger.close(1)


def test_pending_points_stay_while_the_api_answers_500_and_reach_the_run_once_it_answers(
        tmp_path, switch, mlflow_server):
    from relaunch.components.core.tracking.mlflow_tracker import deliver_pending_metrics

    config, run_id = _run(switch.uri, "switch-pending")
    store = open_store(str(tmp_path / "store"))
    points = [[step, {"train/loss": 1.0 / step}] for step in range(1, 21)]
    tags = {"relaunch.tracking.lost_contact": "true", "relaunch.tracking.lost_contact_events": "1"}
    records.write_pending_metrics(store, 20, points, tags, "FINISHED")

    switch.off()
    assert not deliver_pending_metrics(config, store, run_id, who="test")
    assert records.read_pending(store) == {"points": points, "tags": tags, "status": "FINISHED"}  # nothing lost
    switch.on()
    assert deliver_pending_metrics(config, store, run_id, who="test")

    assert records.read_pending_metrics(store) == [] and records.read_pending(store)["tags"] == {}
    client = MlflowClient(mlflow_server.uri)
    run = client.get_run(run_id)
    assert sorted(m.step for m in client.get_metric_history(run_id, "train/loss")) == list(range(1, 21))
    assert run.data.tags["relaunch.tracking.lost_contact"] == "true"
    assert run.info.status == "FINISHED"
