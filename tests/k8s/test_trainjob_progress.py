"""TrainJob progress (components/core/trainer/progress.py, KEP-2779): rank 0's reports reach
``status.trainerStatus`` of its TrainJob through the real ``kubernetes`` client against kmock's API emulator,
and the launcher prints them; Trainer's progress server is played by a small HTTP server (the fake at the
HTTP edge: its TLS and token review are what only a real cluster can confirm); an answer of 404 turns
reporting off with one line and no error."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from relaunch.components.core.trainer.progress import (NAMESPACE_ENV, TRAINJOB_ENV, ApiSink, ProgressReporter, ServerSink,
                                              open_sink)
from relaunch.components.launchers.trainjob import JOBSET_LABEL, build_runtime
from tests.k8s.conftest import NAMESPACE
from tests.k8s.test_launcher_contract import start_launch


def _report(reporter: ProgressReporter, steps: int) -> None:
    for step in range(1, steps + 1):
        reporter.step_done(step, steps, {"loss": 1.0 / step, "epoch": step // 5})
    reporter.flush(10)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["trainjob"])
async def test_rank_0_reports_progress_into_the_trainjob_status_and_the_launcher_prints_it(
        cluster, k8s_config, monkeypatch, capfd):
    task = start_launch(k8s_config)
    await cluster.wait_for(lambda: cluster.jobs(), "the job to be created")
    job = cluster.jobs()[0]
    # what the runtime's downward-API env resolves to in a pod of this TrainJob (its node-0 pod's labels)
    _pod, labels = cluster.op.node0_pod(job["metadata"]["name"])
    runtime_env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in build_runtime(k8s_config)[
        "spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]["env"]
        if "fieldRef" in e.get("valueFrom", {})}
    assert runtime_env[TRAINJOB_ENV] == f"metadata.labels['{JOBSET_LABEL}']"
    assert runtime_env[NAMESPACE_ENV] == "metadata.namespace"
    await cluster.set_status(job["metadata"]["name"], cluster.op.running())
    monkeypatch.setenv(TRAINJOB_ENV, labels[JOBSET_LABEL])
    monkeypatch.setenv(NAMESPACE_ENV, job["metadata"]["namespace"])
    sink = open_sink()
    assert isinstance(sink, ApiSink)
    reporter = ProgressReporter(sink, interval=0.0)
    await asyncio.to_thread(_report, reporter, 10)

    status = cluster.jobs()[0]["status"]["trainerStatus"]
    assert status["progressPercentage"] == 100 and status["estimatedRemainingSeconds"] == 0
    assert {m["name"]: m["value"] for m in status["metrics"]} == {"loss": "0.1", "epoch": "2"}
    assert re.match(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$", status["lastUpdatedTime"])
    assert reporter.on and reporter.sent >= 1
    assert (await cluster.finish(task, job["metadata"]["name"], cluster.op.succeeded())).exit_code == 0
    assert re.search(r"100% ~0 s left loss=0\.1 epoch=2", capfd.readouterr().err)


@pytest.mark.asyncio
@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["trainjob"])
async def test_a_trainjob_the_api_does_not_serve_turns_reporting_off_with_one_line(cluster, capfd):
    reporter = ProgressReporter(ApiSink("no-such-trainjob", NAMESPACE), interval=0.0)
    await asyncio.to_thread(_report, reporter, 5)
    await asyncio.to_thread(_report, reporter, 5)  # off: nothing more is sent, nothing raised
    assert not reporter.on and reporter.sent == 0
    lines = [line for line in capfd.readouterr().err.splitlines() if "relaunch: progress:" in line]
    assert len(lines) == 1 and "does not serve TrainJob progress (HTTP 404" in lines[0]


class FakeProgressServer(BaseHTTPRequestHandler):
    """Trainer's progress server as the SDK's helper talks to it: POST {"trainerStatus": ...} with a bearer token."""

    answer = 200
    received: list = []

    def do_POST(self):  # noqa: N802 - the stdlib's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.received.append((self.path, self.headers.get("Authorization"), body))
        self.send_response(self.answer)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("answer", [200, 404])
def test_trainers_progress_server_gets_the_sdk_helpers_body_and_a_404_turns_reporting_off(
        answer, tmp_path, monkeypatch, capfd):
    FakeProgressServer.answer, FakeProgressServer.received = answer, []
    server = HTTPServer(("127.0.0.1", 0), FakeProgressServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        token = tmp_path / "token"
        token.write_text("projected-token\n")
        path = f"/apis/trainer.kubeflow.org/v1alpha1/namespaces/{NAMESPACE}/trainjobs/tj/status"
        monkeypatch.setenv("KUBEFLOW_TRAINER_SERVER_URL", f"http://127.0.0.1:{server.server_port}{path}")
        monkeypatch.setenv("KUBEFLOW_TRAINER_SERVER_TOKEN", str(token))
        monkeypatch.setenv(TRAINJOB_ENV, "ignored-when-the-server-is-offered")
        sink = open_sink()
        assert isinstance(sink, ServerSink)
        reporter = ProgressReporter(sink, interval=0.0)
        _report(reporter, 4)
        _report(reporter, 4)
    finally:
        server.shutdown()
    requests = FakeProgressServer.received
    assert requests and all(p == path and auth == "Bearer projected-token" for p, auth, _ in requests)
    if answer == 200:
        assert reporter.on and requests[-1][2]["trainerStatus"]["progressPercentage"] == 100
    else:
        assert not reporter.on and len(requests) == 1
        assert capfd.readouterr().err.count("does not serve TrainJob progress") == 1
