"""A real torchrun training under an (emulated) TrainJob: rank 0 alone reports progress to Trainer's progress
server (a plain HTTP stand-in, tests/k8s/test_trainjob_progress.py), once at the end with 100 %."""

from __future__ import annotations

import threading
from http.server import HTTPServer

import pytest

from tests.k8s.test_trainjob_progress import FakeProgressServer
from tests.train.conftest import run_torchrun, train_config

pytestmark = pytest.mark.slow


def test_rank_0_of_a_real_training_reports_progress_to_the_end(tmp_path):
    FakeProgressServer.answer, FakeProgressServer.received = 200, []
    server = HTTPServer(("127.0.0.1", 0), FakeProgressServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    token = tmp_path / "token"
    token.write_text("t")
    try:
        run = run_torchrun(train_config(tmp_path, f"sqlite:///{tmp_path / 'mlflow.db'}", max_steps=20), tmp_path,
                           env={"KUBEFLOW_TRAINER_SERVER_URL": f"http://127.0.0.1:{server.server_port}/status",
                                "KUBEFLOW_TRAINER_SERVER_TOKEN": str(token)})
    finally:
        server.shutdown()
    assert run.proc.returncode == 0, run.output()[-3000:]
    reports = [body["trainerStatus"] for _path, _auth, body in FakeProgressServer.received]
    assert reports and reports[-1]["progressPercentage"] == 100 and reports[-1]["estimatedRemainingSeconds"] == 0
    assert [m["name"] for m in reports[-1]["metrics"]] == ["loss"]
    percents = [r["progressPercentage"] for r in reports]
    assert percents == sorted(percents) and percents.count(100) == 1, "one rank reports, once at the end"
