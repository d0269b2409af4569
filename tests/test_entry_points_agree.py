"""One failure, one exit code, whatever the entry point: the same exceptions raised inside a real step run
the Argo way (``python -m relaunch.components.prepare``), the KFP way (the component body's ``kfp_entry.call``) and
inside a real training worker (``python -m relaunch.components.train``) end with the same contract code, so the
retry decision (Argo's expression, KFP's retry, the PyTorchJob's ExitCode policy) is the same on each."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from relaunch.components.core.contract.exitcodes import ExitCode, is_retryable

FAILURES = [  # (what the task raises, the contract's code)
    ("store-connection", ExitCode.RETRY_ME),  # urllib3's MaxRetryError, as minio raises it
    ("mlflow-503", ExitCode.RETRY_ME),  # MlflowException TEMPORARILY_UNAVAILABLE
    ("keyerror", ExitCode.BUG),
    ("bad-input", ExitCode.BAD_INPUT),
]


def _config(tmp_path) -> str:
    return json.dumps({"store": {"uri": str(tmp_path / "store")},
                       "tracking": {"uri": f"sqlite:///{tmp_path}/mlflow.db"},
                       "train": {"task": "tests.tasks.failing:make_task", "max_steps": 2}})


ENTRY_POINTS = {
    "argo": lambda cfg: [sys.executable, "-m", "relaunch.components.prepare", "--config-json", cfg],
    "kfp": lambda cfg: [sys.executable, "-c", f"from relaunch.pipelines.kfp_entry import call; call('prepare', {cfg!r})"],
    "worker": lambda cfg: [sys.executable, "-m", "relaunch.components.train", "--config-json", cfg],
}


@pytest.mark.parametrize("kind,code", FAILURES, ids=[f[0] for f in FAILURES])
def test_a_failure_ends_with_the_same_code_and_retry_decision_on_every_entry_point(tmp_path, kind, code):
    ended = {}
    for name, command in ENTRY_POINTS.items():
        proc = subprocess.run(command(_config(tmp_path / name)), capture_output=True, text=True, timeout=300,
                              env={**os.environ, "RELAUNCH_TEST_FAILURE": kind, "PYTHONPATH": os.getcwd()})
        last = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ""
        ended[name] = (proc.returncode, is_retryable(proc.returncode), "error:" in last)
    assert ended == {name: (int(code), is_retryable(code), True) for name in ENTRY_POINTS}
