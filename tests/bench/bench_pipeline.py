"""Where a ``relaunch run`` spends its wall time: per step, next to the time the step's processes spent importing.

Runs the whole local pipeline (2 torchrun "nodes" on CPU, embedded store and MLflow, in a temporary
directory) twice: once plainly, for the wall time and each step's seconds from the run's event
file, and once with ``PYTHONPROFILEIMPORTTIME=1``, for the seconds every process of each step
(kfp's executor, torchrun agents and workers) spent in imports (the sum of its top-level imports;
importtime's own overhead makes these a little high), and the packages those seconds went to
(``heaviest_imports``). "training" is the productive time the trainer measured (goodput);
everything else is overhead.

With ``RELAUNCH_BENCH_BASELINE=/path/to/another/checkout`` the plain run is also made with that
source tree first (``PYTHONPATH``), back to back, and each row gets the baseline's seconds and the
ratio: the only fair comparison on a shared machine.

    make bench ARGS="pipeline"
    RELAUNCH_BENCH_BASELINE=/tmp/relaunch-main make bench ARGS="pipeline --quick"
"""

from __future__ import annotations

import collections
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from components import STEP_TABLE

_TASK = re.compile(r"Executing task .*?'(?:\x1b\[[0-9;]*m)?([a-z-]+)")
_IMPORT = re.compile(r"import time:\s+\d+ \|\s+(\d+) \| (\S.*)$")


def _relaunch_run(steps: int, *, source: str | None = None, import_times: bool = False) -> dict:
    """One ``relaunch run`` in a fresh directory: wall and CPU seconds, its events and its log."""
    env = dict(os.environ)
    if source:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [source, env.get("PYTHONPATH")]))
    if import_times:
        env["PYTHONPROFILEIMPORTTIME"] = "1"
    command = [sys.executable, "-c", "import sys; from pipelines.cli import main; sys.exit(main())",
               "run", "--set", f"train.max_steps={steps}"]
    with tempfile.TemporaryDirectory(prefix="bench-pipeline-") as tmp:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.monotonic()
        out = subprocess.run(command, cwd=tmp, capture_output=True, text=True, timeout=900, env=env)
        wall = time.monotonic() - started
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if out.returncode != 0:
            raise RuntimeError(f"relaunch run failed ({out.returncode}): {out.stderr[-500:]}")
        runs = Path(tmp, ".relaunch", "runs")
        events = [json.loads(line) for f in runs.rglob("events.jsonl") for line in f.read_text().splitlines()]
        log = "\n".join(f.read_text(errors="replace") for f in runs.rglob("pipeline.log"))
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall": wall, "cpu": cpu, "events": events, "log": log}


def step_seconds(events: list[dict]) -> dict[str, tuple[float, float]]:
    """Step -> (seconds from its start to its end event, training seconds inside it)."""
    starts = {e["step"]: e["time"] for e in events if e["kind"] == "step-start"}
    out = {}
    for e in events:
        if e["kind"] == "step-end" and e["step"] in starts:
            training = float(e.get("outputs", {}).get("train_seconds", 0.0)) if e["step"] == "launch" else 0.0
            out[e["step"]] = (e["time"] - starts[e["step"]], training)
    return out


def import_seconds(log: str) -> dict[str, float]:
    """Step -> seconds its processes spent in top-level imports, from a ``PYTHONPROFILEIMPORTTIME`` log."""
    return {step: sum(packages.values()) for step, packages in package_import_seconds(log).items()}


def package_import_seconds(log: str) -> dict[str, dict[str, float]]:
    """Step -> {top-level package: seconds every process of the step spent importing it (with what it
    imports)}, from a ``PYTHONPROFILEIMPORTTIME`` log."""
    totals: dict[str, dict[str, float]] = collections.defaultdict(lambda: collections.defaultdict(float))
    step = None
    for line in log.splitlines():
        task = _TASK.search(line)
        if task:
            step = task.group(1)
            continue
        found = _IMPORT.search(line)
        if found and step and not found.group(2).startswith(" "):  # top level: the name is not indented
            totals[step][found.group(2).split(".")[0]] += int(found.group(1)) / 1e6
    return totals


def heaviest(packages: dict[str, float], n: int = 4) -> str:
    """``"torch 4.1, mlflow 3.2, ..."``: where a step's import seconds go."""
    return ", ".join(f"{name} {seconds:.1f}" for name, seconds in sorted(packages.items(), key=lambda kv: -kv[1])[:n])


def run(quick: bool) -> list[dict]:
    steps = 20 if quick else 120
    baseline_source = os.environ.get("RELAUNCH_BENCH_BASELINE")
    baseline = _relaunch_run(steps, source=baseline_source) if baseline_source else None
    plain = _relaunch_run(steps)
    packages = package_import_seconds(_relaunch_run(steps, import_times=True)["log"])
    imports = {step: sum(seconds.values()) for step, seconds in packages.items()}
    seconds = step_seconds(plain["events"])
    base_seconds = step_seconds(baseline["events"]) if baseline else {}

    rows, accounted = [], 0.0
    wall = plain["wall"]
    for step in STEP_TABLE:
        if step not in seconds:
            continue
        took, training = seconds[step]
        accounted += took
        row = {"step": step, "seconds": took, "imports_s": imports.get(step, 0.0), "training_s": training,
               "overhead_s": took - training, "overhead_share_of_wall": (took - training) / wall,
               "heaviest_imports": heaviest(packages.get(step, {}))}
        if baseline:
            row.update(baseline_s=base_seconds.get(step, (0.0, 0.0))[0],
                       ratio=took / base_seconds[step][0] if base_seconds.get(step, (0, 0))[0] else 0.0)
        rows.append(row)
    training = sum(r["training_s"] for r in rows)
    between = {"step": "between steps (kfp.local, process start)", "seconds": wall - accounted,
               "imports_s": 0.0, "training_s": 0.0, "overhead_s": wall - accounted,
               "overhead_share_of_wall": (wall - accounted) / wall, "heaviest_imports": ""}
    total = {"step": f"total relaunch run ({steps} steps), wall", "seconds": wall, "imports_s": sum(imports.values()),
             "training_s": training, "overhead_s": wall - training, "overhead_share_of_wall": (wall - training) / wall,
             "heaviest_imports": ""}
    cpu = {"step": "total CPU seconds (all processes)", "seconds": plain["cpu"], "imports_s": 0.0,
           "training_s": 0.0, "overhead_s": 0.0, "overhead_share_of_wall": 0.0, "heaviest_imports": ""}
    if baseline:
        base_accounted = sum(v[0] for v in base_seconds.values())
        between.update(baseline_s=baseline["wall"] - base_accounted,
                       ratio=(wall - accounted) / max(1e-9, baseline["wall"] - base_accounted))
        total.update(baseline_s=baseline["wall"], ratio=wall / baseline["wall"])
        cpu.update(baseline_s=baseline["cpu"], ratio=plain["cpu"] / baseline["cpu"])
    return rows + [between, total, cpu]
