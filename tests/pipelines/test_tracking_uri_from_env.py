"""``MLFLOW_TRACKING_URI`` from the environment wins over ``tracking.uri`` and is held to the same checks:
a malformed one is a single line on stderr naming the variable and the fix, exit code 2, nothing written
(the way a person types it, through the real ``relaunch`` CLI)."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = [
    # (MLFLOW_TRACKING_URI, what the one line must say)
    ("sqlite:mlflow.db", "write the URI as sqlite:///mlflow.db"),
    ("http:/mlflow:5000", "write the URI as http://mlflow:5000"),
    ("HTTP://mlflow:5000", "lowercase: http://mlflow:5000"),
    ("./mlruns", "a path is not one"),
    ("ftp://mlflow/x", "scheme 'ftp'"),
    ("http://user:secret@mlflow:5000", "MLFLOW_TRACKING_USERNAME"),
]


def _run(uri: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "MINIO_", "MLFLOW_", "KF_PIPELINES"))}
    env.update(PYTHONPATH=str(REPO), HOME=str(cwd), COLUMNS="80", MLFLOW_TRACKING_URI=uri)
    return subprocess.run([sys.executable, "-m", "relaunch.pipelines.cli", "run", "--set", "train.epochs=1"], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=300)


def test_a_malformed_mlflow_tracking_uri_is_one_line_exit_2_naming_the_variable_and_changes_nothing(tmp_path):
    with ThreadPoolExecutor(max_workers=2) as pool:
        done = list(pool.map(lambda case: (case, _run(case[0], tmp_path)), SCRIPT))
    wrong = []
    for (uri, expected), proc in done:
        err = proc.stderr.strip().splitlines()
        if proc.returncode != 2 or len(err) != 1 or "MLFLOW_TRACKING_URI" not in err[0] or expected not in err[0]:
            wrong.append(f"MLFLOW_TRACKING_URI={uri}: exit {proc.returncode}, stderr {err[-3:]!r}")
    assert not wrong, "\n".join(wrong)
    assert list(tmp_path.iterdir()) == [], "a malformed MLFLOW_TRACKING_URI wrote something"


def test_a_well_formed_mlflow_tracking_uri_wins_over_the_config(monkeypatch):
    from relaunch.components.core.contract.config import RelaunchConfig
    from relaunch.components.core.tracking.client import tracking_uri

    config = RelaunchConfig.model_validate({"tracking": {"uri": "sqlite:///from-config.db"}})
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert tracking_uri(config) == "sqlite:///from-config.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.example:5000")
    assert tracking_uri(config) == "http://mlflow.example:5000"
