"""Helpers of the training tests: real torchrun subprocesses on 127.0.0.1 with gloo, small configs,
and readers of what a training left in its store and in MLflow."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from relaunch.pipelines.local.warm_steps import RemoteProcess
from tests import warm_processes
from tests.services import free_port

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
# Restarts must be fast: poll workers every 0.2 s, close the rendezvous 1 s after the last join.
RDZV_CONF = "join_timeout=30,last_call_timeout=1,close_timeout=2"
SUPERVISE = [sys.executable, "-m", "relaunch.components.launchers.supervise"]
"""The container's supervisor, as a prefix of :func:`start_torchrun`'s command."""


def train_config(tmp_path: Path, tracking_uri: str, **train) -> dict:
    """A tiny training: 40 steps of the digits MLP, a checkpoint every 10 steps."""
    return {
        "store": {"uri": str(tmp_path / "store")},
        "tracking": {"uri": tracking_uri, "experiment": f"test-{uuid.uuid4().hex[:8]}"},
        "train": {"max_steps": 40, "checkpoint_every_steps": 10, "hidden_size": 32, **train},
    }


@dataclass
class Torchrun:
    """A running ``torchrun -m relaunch.components.train`` with its combined output in a file."""

    proc: subprocess.Popen | RemoteProcess
    log: Path
    started_at: float = field(default_factory=time.time)

    def wait(self, timeout: float = 180) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
            raise AssertionError(f"torchrun did not end within {timeout}s; output:\n{self.output()[-4000:]}")

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def records(self, kind: str) -> list[dict]:
        """The fields of every event of ``kind`` (a :class:`relaunch.components.core.contract.events.Kind` name, e.g.
        ``SAVING``) printed so far, read with the one reader."""
        from relaunch.components.core.contract import events

        found = (events.read(line) for line in self.output().splitlines())
        return [e.fields for e in found if e is not None and e.kind == events.Kind[kind]]

    def wait_for(self, kind: str, predicate=lambda r: True, timeout: float = 120) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for record in self.records(kind):
                if predicate(record):
                    return record
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"no {kind} event matched; output:\n{self.output()[-4000:]}")

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)


def start_torchrun(config: dict, tmp_path: Path, *, nproc: int = 2, max_restarts: int = 0,
                   env: dict | None = None, name: str = "run", extra_args: list[str] | None = None,
                   prefix: list[str] | None = None) -> Torchrun:
    log = tmp_path / f"{name}-{uuid.uuid4().hex[:6]}.log"
    child_env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_TRACKING_URI", "RELAUNCH_"))}
    child_env.update({"PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", **(env or {})})
    argv = [*(prefix or []), str(BIN / "torchrun"), "--nnodes=1", f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}",
            "--monitor-interval=0.2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
            f"--rdzv-id={uuid.uuid4().hex[:8]}", f"--rdzv-conf={RDZV_CONF}", "--shutdown-timeout=20",
            *(extra_args or []), "-m", "relaunch.components.train", "--config-json", json.dumps(config)]
    with log.open("w") as out:
        proc = warm_processes.start(argv, cwd=ROOT, env=child_env, stdout=out, stderr=out, new_session=True)
    return Torchrun(proc, log)


def run_torchrun(config: dict, tmp_path: Path, **kwargs) -> Torchrun:
    run = start_torchrun(config, tmp_path, **kwargs)
    run.wait()
    return run


def final_params(store_uri: str, hidden_size: int = 32) -> dict:
    """The model parameters of the latest committed checkpoint, loaded in this process."""
    from relaunch.components.core.checkpoint import CheckpointManager
    from relaunch.components.core.contract.config import RelaunchConfig
    from relaunch.components.core.trainer.state import TrainingState
    from relaunch.components.tasks.digits import make_task

    config = RelaunchConfig.model_validate({"train": {"hidden_size": hidden_size}})
    model = make_task(config).build_model()
    manager = CheckpointManager(store_uri)
    manager.load(TrainingState(model))
    manager.close()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def mlflow_runs(tracking_uri: str, experiment: str) -> list:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    return [] if exp is None else client.search_runs([exp.experiment_id])


def metric_steps(tracking_uri: str, run_id: str, key: str = "train/loss") -> list[int]:
    from mlflow.tracking import MlflowClient

    return [m.step for m in MlflowClient(tracking_uri).get_metric_history(run_id, key)]


@pytest.fixture
def tracking(mlflow_server):
    """The session's real MLflow server (Postgres backend)."""
    return mlflow_server.uri
