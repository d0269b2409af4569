"""A tracking server that half-works, through the whole pipeline (``relaunch run``: kfp.local, real torchrun):
a real ``mlflow server`` behind a switch (:mod:`tests.tracking_switch`) whose API answers 500 while its
``/health`` answers 200 — for a while in mid-training, until after the pipeline ended, or from the start."""

from __future__ import annotations

import json
import re
import threading
import uuid
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from relaunch.components.core.contract.exitcodes import ExitCode
from relaunch.components.core.store import open_store
from relaunch.components.core.store.records import read_pending_metrics
from relaunch.components.core.tracking.client import TRIES
from tests.cli import RUN_TIMEOUT, newest_training, relaunch_run
from tests.tracking_switch import TrackingSwitch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2 * RUN_TIMEOUT + 60)]

STEPS = 80


@pytest.fixture
def switch(mlflow_server):
    switch = TrackingSwitch(mlflow_server.uri).start()
    yield switch
    switch.stop()


def _names() -> list[str]:
    """A fresh experiment and registered model: the session's server is shared."""
    tag = uuid.uuid4().hex[:8]
    return ["--set", f"tracking.experiment=outage-{tag}", "--set", f"registry.model_name=outage-{tag}"]


def _training(switch: TrackingSwitch, *extra: str) -> list[str]:
    return ["--set", f"train.max_steps={STEPS}", "--set", "train.step_sleep_seconds=0.1",
            "--set", f"tracking.uri={switch.uri}", *extra]


def _events(cwd: Path) -> list[dict]:
    out = []
    for path in sorted((cwd / ".relaunch" / "runs").rglob("events.jsonl")):
        out += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return out


class Operator(threading.Thread):
    """Turns the switch off once the training passed ``off_at`` steps and, with ``heal``, on again once
    the training said it lost contact (or, where it never says so, once its attempt ended)."""

    def __init__(self, cwd: Path, switch: TrackingSwitch, *, off_at: int, heal: bool):
        super().__init__(daemon=True)
        self.cwd, self.switch, self.off_at, self.heal = cwd, switch, off_at, heal
        self.done = threading.Event()
        self.turned_off = self.turned_on = False

    def run(self) -> None:
        while not self.done.wait(0.1):
            if not (self.cwd / ".relaunch" / "runs").exists():
                continue
            events = _events(self.cwd)
            if not self.turned_off:
                if any(e["kind"] == "progress" and e["step"] >= self.off_at for e in events):
                    self.switch.off()
                    self.turned_off = True
            elif self.heal and not self.turned_on:
                if any(e["kind"] == "tracking" and "lost contact" in e["line"] or e["kind"] == "summary"
                       for e in events):
                    self.switch.on()
                    self.turned_on = True


def _run_of(uri: str, experiment: str):
    client = MlflowClient(uri)
    [run] = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return client, run


def _loss_steps(client: MlflowClient, run_id: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, "train/loss"))


def test_a_tracking_api_answering_500_in_mid_training_loses_no_loss_point_and_the_console_says_lost_and_back(
        tmp_path, switch, mlflow_server):
    names = _names()
    operator = Operator(tmp_path, switch, off_at=3, heal=True)
    operator.start()
    try:
        out = relaunch_run(tmp_path, *_training(switch, *names))
    finally:
        operator.done.set()
    assert operator.turned_off and operator.turned_on
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]

    lost = [line for line in out.stdout.splitlines() if "lost contact with the tracking server" in line]
    back = [re.search(r"back after [\d.]+s; sending the (\d+) metric points buffered", line)
            for line in out.stdout.splitlines()]
    back = [int(m.group(1)) for m in back if m]
    assert len(lost) == 1 and switch.uri in lost[0], out.stdout[-3000:]
    assert len(back) == 1 and back[0] > 0, out.stdout[-3000:]

    client, run = _run_of(mlflow_server.uri, names[1].split("=", 1)[1])
    assert _loss_steps(client, run.info.run_id) == list(range(1, STEPS + 1))
    assert run.data.tags["relaunch.tracking.lost_contact"] == "true"
    assert int(run.data.tags["relaunch.tracking.lost_contact_events"]) >= 1
    assert float(run.data.tags["relaunch.tracking.lost_contact_seconds"]) > 0
    assert run.info.status == "FINISHED"


@pytest.mark.ci_lane  # the delivery itself: test_tracking_switch's pending points reach the run once it answers;
# prepare's call of it on every run: test_a_tracking_api_answering_500_in_mid_training_loses_no_loss_point_…
def test_points_kept_through_an_outage_that_outlasts_the_pipeline_reach_the_run_on_resume(
        tmp_path, switch, mlflow_server):
    names = _names()
    operator = Operator(tmp_path, switch, off_at=3, heal=False)
    operator.start()
    try:
        first = relaunch_run(tmp_path, *_training(switch, *names))
    finally:
        operator.done.set()
    assert operator.turned_off
    # trained to its end; evaluate could not reach the server, within its tries, and the pipeline ended
    assert first.returncode == ExitCode.RETRY_ME, first.stdout[-3000:] + first.stderr[-3000:]
    assert "lost contact with the tracking server" in first.stdout
    assert f"(try 1/{TRIES})" in first.stdout  # a line per failed call, on the console
    store = open_store(newest_training(str(tmp_path / ".relaunch" / "store")))
    kept = read_pending_metrics(store)
    assert kept and kept[-1][0] == STEPS, kept[-3:]

    switch.on()
    again = relaunch_run(tmp_path, "--resume", "--set", f"tracking.uri={switch.uri}")
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert re.search(r"prepare: sent the \d+ metric points", again.stdout), again.stdout[-3000:]
    client, run = _run_of(mlflow_server.uri, names[1].split("=", 1)[1])
    assert _loss_steps(client, run.info.run_id) == list(range(1, STEPS + 1))
    assert run.data.tags["relaunch.tracking.lost_contact"] == "true"
    assert int(run.data.tags["relaunch.tracking.lost_contact_events"]) >= 1
    assert read_pending_metrics(store) == []
    assert run.info.status == "FINISHED"


def test_a_server_whose_api_answers_500_from_the_start_is_named_at_once_with_a_line_per_try_and_exit_138(
        tmp_path, switch):
    switch.off()
    out = relaunch_run(tmp_path, "--set", f"tracking.uri={switch.uri}", *_names(), timeout=180)
    assert out.returncode == ExitCode.RETRY_ME, out.stdout[-3000:] + out.stderr[-3000:]
    tries = [line for line in out.stderr.splitlines() if "could not get an answer from the MLflow API" in line]
    assert len(tries) == TRIES, out.stderr  # one line per failed try, the last one the error
    assert all(switch.uri in line and "500" in line for line in tries), tries
    assert [f"(try {n}/{TRIES})" in line for n, line in enumerate(tries[:-1], 1)] == [True] * (TRIES - 1)
    assert tries[-1].startswith("relaunch: error:"), tries
    assert not (tmp_path / ".relaunch" / "store" / "trainings").exists()  # nothing started
    assert switch.refused == TRIES
