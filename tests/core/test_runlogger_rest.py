"""The run logger's REST path (components/core/tracking/rest.py): the credentials MLflow's client would
send, its errors, its fallback to MLflow's client where it cannot reproduce the request, and the number
of requests a training's points take, against a real ``mlflow server``."""

from __future__ import annotations

import http.server
import threading

import pytest


class _Recorder(http.server.BaseHTTPRequestHandler):
    """Answers every request with ``{}`` and keeps its headers and body: what a client sent, nothing
    more; while ``down`` is set it answers 503 instead (a tracking server behind a load balancer,
    restarting) and keeps nothing."""

    seen: list = []
    down = threading.Event()

    def _answer(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if type(self).down.is_set():
            self.send_response(503)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        type(self).seen.append((self.command, self.path, dict(self.headers), body))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    do_GET = do_POST = _answer

    def log_message(self, *args):
        pass


@pytest.fixture()
def recorder():
    _Recorder.seen = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", _Recorder.seen
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("env", [
    {"MLFLOW_TRACKING_USERNAME": "relaunch", "MLFLOW_TRACKING_PASSWORD": "s3cr:et"},
    {"MLFLOW_TRACKING_TOKEN": "a-token"},
    {"MLFLOW_TRACKING_USERNAME": "relaunch", "MLFLOW_TRACKING_PASSWORD": "pw", "MLFLOW_TRACKING_TOKEN": "a-token"},
    {},
], ids=["basic", "token", "basic-wins", "none"])
def test_the_plain_path_authenticates_exactly_as_mlflows_client(recorder, monkeypatch, tmp_path, env):
    from mlflow.utils.credentials import get_default_host_creds
    from mlflow.utils.rest_utils import http_request

    from relaunch.components.core.tracking.rest import LOG_BATCH, RestSession

    uri, seen = recorder
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.mlflow/credentials of the machine's
    for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN", "HTTP_PROXY",
                 "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    session = RestSession(uri)
    assert session.plain
    session.post(LOG_BATCH, {"run_id": "r"})
    http_request(get_default_host_creds(uri), "/api/2.0/mlflow/runs/log-batch", "POST", json={"run_id": "r"})
    (_, ours_path, ours, _), (_, theirs_path, theirs, _) = seen
    assert ours_path == theirs_path == "/api/2.0/mlflow/runs/log-batch"
    assert ours.get("Authorization") == theirs.get("Authorization")


def test_a_proxy_in_the_environment_sends_through_mlflows_client_instead(monkeypatch):
    from relaunch.components.core.tracking.rest import RestSession

    for name in ("NO_PROXY", "no_proxy", "ALL_PROXY", "all_proxy", "HTTPS_PROXY", "https_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.example:3128")
    monkeypatch.setenv("http_proxy", "http://proxy.example:3128")
    assert not RestSession("http://mlflow.example:5000").plain
    monkeypatch.setenv("NO_PROXY", "mlflow.example")
    monkeypatch.setenv("no_proxy", "mlflow.example")
    assert RestSession("http://mlflow.example:5000").plain
    monkeypatch.setenv("MLFLOW_TRACKING_AUTH", "some-plugin")  # an auth plugin: only MLflow's client runs it
    assert not RestSession("http://mlflow.example:5000").plain


@pytest.mark.slow
def test_the_plain_path_raises_mlflows_errors_for_a_missing_run_and_an_oversized_batch(mlflow_server):
    from relaunch.components.core.tracking.client import ensure_run, is_not_found, is_rejected
    from relaunch.components.core.contract.config import RelaunchConfig
    from relaunch.components.core.tracking.rest import GET_RUN, LOG_BATCH, RestSession

    session = RestSession(mlflow_server.uri)
    assert session.plain
    with pytest.raises(Exception) as missing:
        session.get(GET_RUN, run_id="0" * 32)
    assert is_not_found(missing.value)
    run_id = ensure_run(RelaunchConfig.model_validate({"tracking": {"uri": mlflow_server.uri, "experiment": "rest"}}))
    metrics = [{"key": "m", "value": 1.0, "timestamp": 1, "step": s} for s in range(1001)]
    with pytest.raises(Exception) as oversized:
        session.post(LOG_BATCH, {"run_id": run_id, "metrics": metrics})
    assert is_rejected(oversized.value)


@pytest.mark.slow
def test_a_trainings_points_take_one_request_per_thousand_and_params_and_status_go_over_rest(mlflow_server):
    from mlflow.tracking import MlflowClient

    from relaunch.components.core.contract.config import RelaunchConfig
    from relaunch.components.core.tracking.client import ensure_run
    from relaunch.components.core.tracking.runlogger import RunLogger

    run_id = ensure_run(RelaunchConfig.model_validate({"tracking": {"uri": mlflow_server.uri,
                                                                    "experiment": "rest-requests"}}))
    logger = RunLogger(mlflow_server.uri, run_id, defer_start=True)
    for step in range(1, 400):  # 1995 points and a tag: two log-batch requests, after one runs/get
        logger.log_metrics({f"m/{i}": float(step) for i in range(4)} | {"nan": float("nan")}, step)
    logger.set_tags({"relaunch.test": "yes"})
    assert logger.flush(60)
    assert logger.rest_requests == 3 and logger.stats.points_sent == 1995
    logger.log_params({"a": 1, "b": "x"})
    logger.log_params({"a": 1, "b": "y"})
    logger.set_status("FINISHED")
    assert logger.close(60) and logger.stats.dropped_ops == 0
    run = MlflowClient(mlflow_server.uri).get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.end_time
    assert run.data.params == {"a": "1", "b": "x"} and run.data.tags["param.b.latest"] == "y"
    assert run.data.tags["relaunch.test"] == "yes"
    history = MlflowClient(mlflow_server.uri).get_metric_history(run_id, "nan")
    assert len(history) == 399 and all(m.value != m.value for m in history)


@pytest.mark.slow
def test_a_step_that_straddles_the_thousand_point_limit_is_split_and_an_empty_call_sends_nothing(mlflow_server):
    from mlflow.tracking import MlflowClient

    from relaunch.components.core.contract.config import RelaunchConfig
    from relaunch.components.core.tracking.client import ensure_run
    from relaunch.components.core.tracking.runlogger import RunLogger

    run_id = ensure_run(RelaunchConfig.model_validate({"tracking": {"uri": mlflow_server.uri,
                                                                    "experiment": "rest-split"}}))
    logger = RunLogger(mlflow_server.uri, run_id, defer_start=True)
    for step in range(1, 151):  # 7 keys: step 143 holds points 995..1001, across two requests
        logger.log_metrics({f"k/{i}": float(step * 10 + i) for i in range(7)}, step)
        logger.log_metrics({}, step)
    assert logger.close(60) and logger.stats.points_sent == 1050 and logger.rest_requests == 3  # runs/get + 2
    client = MlflowClient(mlflow_server.uri)
    for i in range(7):
        history = client.get_metric_history(run_id, f"k/{i}")
        assert sorted((m.step, m.value) for m in history) == [(s, float(s * 10 + i)) for s in range(1, 151)]


def test_a_long_outage_keeps_only_the_newest_points_within_the_cap_and_every_param_and_tag(recorder):
    import json
    import time

    from relaunch.components.core.tracking.runlogger import RunLogger

    uri, seen = recorder
    _Recorder.down.set()
    try:
        logger = RunLogger(uri, "run-1", flush_seconds=0.05, max_buffered_points=100)
        logger.log_params({"first": 0})
        while not logger.stats.failed_sends:  # contact is lost: what follows is buffered
            time.sleep(0.01)
        for step in range(1000):
            logger.log_metrics({"loss": float(step)}, step)
            if step % 50 == 0:
                logger.set_tags({f"t{step}": step, "last": step})
                logger.log_params({f"p{step}": step})  # each one closes a metrics op of its own
                time.sleep(0.02)
        failed = logger.stats.failed_sends
        while logger.stats.failed_sends < failed + 2:  # two more retries with everything buffered
            time.sleep(0.05)
    finally:
        _Recorder.down.clear()
    assert logger.close(60)
    batches = [json.loads(body) for _, path, _, body in seen if path.endswith("runs/log-batch")]
    points = [m for batch in batches for m in batch.get("metrics", [])]
    params = {p["key"] for batch in batches for p in batch.get("params", [])}
    tags = {t["key"]: t["value"] for batch in batches for t in batch.get("tags", [])}
    assert sorted(int(p["step"]) for p in points) == list(range(900, 1000))
    assert logger.stats.dropped_points == 900
    assert {"first"} | {f"p{s}" for s in range(0, 1000, 50)} <= params
    assert {f"t{s}" for s in range(0, 1000, 50)} <= tags.keys()
    assert tags["relaunch.tracking.dropped_points"] == "900"
    assert tags["last"] == "950"  # the tags of a dropped batch went out in its place: the later value won
