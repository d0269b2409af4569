"""Pipeline overhead of ``relaunch run``: wall time minus the training time inside launch, per step.

Runs the whole local pipeline once (2 torchrun "nodes" on CPU, embedded store and MLflow, in a
temporary directory) and splits its wall time by step from the run's event file. "training" is the
productive time the trainer measured (goodput); everything else is overhead: process start-up and
imports of each kfp.local subprocess, torchrun rendezvous, checkpoint stalls, MLflow calls.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STEPS = ("prepare", "locate-latest-checkpoint", "launch", "evaluate", "register", "finalize")


def run(quick: bool) -> list[dict]:
    steps = 20 if quick else 120
    with tempfile.TemporaryDirectory(prefix="bench-pipeline-") as tmp:
        started = time.monotonic()
        out = subprocess.run([str(Path(sys.executable).parent / "relaunch"), "run", "--set", f"train.max_steps={steps}"],
                             cwd=tmp, capture_output=True, text=True, timeout=900, env=dict(os.environ))
        wall = time.monotonic() - started
        if out.returncode != 0:
            raise RuntimeError(f"relaunch run failed ({out.returncode}): {out.stderr[-500:]}")
        events = [json.loads(l) for f in Path(tmp, ".relaunch", "runs").rglob("events.jsonl")
                  for l in f.read_text().splitlines()]
    starts = {e["step"]: e["time"] for e in events if e["kind"] == "step-start"}
    ends = {e["step"]: e for e in events if e["kind"] == "step-end"}
    rows, accounted = [], 0.0
    for step in STEPS:
        if step not in ends:
            continue
        seconds = ends[step]["time"] - starts[step]
        training = float(ends[step]["outputs"].get("train_seconds", 0.0)) if step == "launch" else 0.0
        accounted += seconds
        rows.append({"step": step, "seconds": seconds, "training_s": training, "overhead_s": seconds - training,
                     "overhead_share_of_wall": (seconds - training) / wall})
    training = sum(r["training_s"] for r in rows)
    rows.append({"step": "between steps (kfp.local, process start)", "seconds": wall - accounted, "training_s": 0.0,
                 "overhead_s": wall - accounted, "overhead_share_of_wall": (wall - accounted) / wall})
    rows.append({"step": f"total relaunch run ({steps} steps)", "seconds": wall, "training_s": training,
                 "overhead_s": wall - training, "overhead_share_of_wall": (wall - training) / wall})
    return rows
