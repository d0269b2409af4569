"""``logging.format: json`` (components/core/runtime/logs.py): a real torchrun training, restarted once, whose
workers' stderr (torchrun's ``--redirects 2`` files) is JSON on every line, labelled with the training, the
attempt, the rank, the node and the step; and a step process whose stderr is too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from relaunch.components.core.contract.config import RelaunchConfig
from relaunch.components.core.runtime.logs import training_id
from tests.train.conftest import ROOT, run_torchrun, train_config

pytestmark = pytest.mark.slow
LABELS = {"time", "level", "message", "training_id", "attempt", "rank", "node", "step"}


def _json_lines(path: Path) -> list[dict]:
    records = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except ValueError:
                raise AssertionError(f"{path}:{number} is not JSON: {line!r}") from None
    return records


def test_every_stderr_line_of_every_worker_is_json_with_the_trainings_labels(tmp_path):
    config = train_config(tmp_path, f"sqlite:///{tmp_path / 'mlflow.db'}", max_steps=30)
    config["logging"] = {"format": "json"}
    config["launch"] = {"inject_failure": "kill-worker@step=15"}
    logs = tmp_path / "worker-logs"
    run = run_torchrun(config, tmp_path, max_restarts=1, extra_args=[f"--log-dir={logs}", "--redirects=2"])
    assert run.proc.returncode == 0, run.output()[-3000:]

    files = sorted(logs.rglob("stderr.log"))
    assert len(files) == 4, files  # two ranks, two attempts
    records = [r for f in files for r in _json_lines(f)]
    assert records, "the workers wrote nothing on stderr"
    assert all(LABELS <= r.keys() for r in records), [r for r in records if not LABELS <= r.keys()][:3]
    expected = training_id(RelaunchConfig.model_validate(config))
    assert {r["training_id"] for r in records} == {expected}
    for f in files:  # torchrun's layout: <run>/attempt_<restarts>/<local rank>/stderr.log
        restarts, rank = int(f.parent.parent.name.split("_")[1]), int(f.parent.name)
        assert all(r["attempt"] == restarts + 1 and r["rank"] == rank for r in _json_lines(f)), f
    assert {r["rank"] for r in records} == {0, 1}
    assert any(isinstance(r["step"], int) and r["step"] >= 15 for r in records), "no line carries a step"


def test_a_step_process_writes_json_lines_on_stderr(tmp_path):
    config = {"store": {"uri": str(tmp_path / "store")}, "logging": {"format": "json"}}
    env = {k: v for k, v in os.environ.items() if not k.startswith("RELAUNCH_")}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run([sys.executable, "-m", "relaunch.components.locate", "--config-json", json.dumps(config),
                           "--set", "train.resume_from=/nonexistent/checkpoints/step-000000000001"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    err = tmp_path / "stderr.log"
    err.write_text(done.stderr)
    records = _json_lines(err)
    assert done.returncode == 2 and records, done.stderr
    assert all(LABELS <= r.keys() and r["role"] == "locate-latest-checkpoint" and r["rank"] is None for r in records)


def test_in_a_container_the_supervisor_makes_the_torchrun_agents_lines_json_too(tmp_path):
    from tests.services import free_port
    from tests.train.conftest import BIN, RDZV_CONF, SUPERVISE

    config = train_config(tmp_path, f"sqlite:///{tmp_path / 'mlflow.db'}", max_steps=6)
    config["logging"] = {"format": "json"}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_TRACKING_URI", "RELAUNCH_"))}
    env.update({"PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "LOGLEVEL": "INFO"})  # torchrun's agent talks
    # and rank 0's MLflow, making the new database itself (no cached empty one to copy: tracking/localdb.py),
    # logs its migrations: the worker lines this test reads
    env["XDG_CACHE_HOME"] = str(tmp_path / "no-cache")
    (tmp_path / "no-cache").write_text("")
    done = subprocess.run(
        [*SUPERVISE, str(BIN / "torchrun"), "--nnodes=1",
         "--nproc-per-node=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-id=logs",
         f"--rdzv-conf={RDZV_CONF}", "-m", "relaunch.components.train", "--config-json", json.dumps(config)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    err = tmp_path / "stderr.log"
    err.write_text(done.stderr)
    records = _json_lines(err)
    assert done.returncode == 0, done.stderr[-3000:]
    roles = {r["role"] for r in records}
    assert {"agent", "worker"} <= roles, roles
    assert all(LABELS <= r.keys() for r in records)
    assert {r["training_id"] for r in records} == {training_id(RelaunchConfig.model_validate(config))}
