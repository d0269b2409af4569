"""A step imports only what it uses: locate lists manifests, so running it must not pay for torch or
MLflow (about 2 s of start-up in every kfp.local subprocess). Checked in a fresh interpreter, the
way the pipeline runs the step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from relaunch.components.core.checkpoint import CheckpointManager
from relaunch.components.core.contract.config import RelaunchConfig

ROOT = Path(__file__).resolve().parents[2]

_LOCATE = """
import json, sys
from relaunch.components.core.runtime.wiring import wire
wire()  # as the step's entry point does
from relaunch.components.core.contract.config import RelaunchConfig
import relaunch.components.locate as locate
out = locate.run(RelaunchConfig.from_json(sys.argv[1]))
print(json.dumps({"step": out.step, "heavy": sorted(m for m in ("torch", "mlflow") if m in sys.modules)}))
"""


def _locate_in_a_fresh_process(config: RelaunchConfig) -> dict:
    done = subprocess.run([sys.executable, "-c", _LOCATE, config.to_json()], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_locating_the_start_point_imports_neither_torch_nor_mlflow(tmp_path):
    config = RelaunchConfig.model_validate({"store": {"uri": str(tmp_path / "store")},
                                            "tracking": {"uri": f"sqlite:///{tmp_path / 'mlflow.db'}"}})
    assert _locate_in_a_fresh_process(config) == {"step": -1, "heavy": []}
    with CheckpointManager(config.store.uri, async_save=False) as mgr:
        mgr.save(7, {"weights": torch.zeros(3)})
    assert _locate_in_a_fresh_process(config) == {"step": 7, "heavy": []}
