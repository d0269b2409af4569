"""Where a ``relaunch run`` spends its wall time: warm (the default) against ``--cold``, per step.

Runs the whole local pipeline (2 torchrun "nodes" on CPU, embedded store and MLflow, each run in a
fresh temporary directory, so MLflow's database is created every time, as on a first ``make run``)
back to back:

- warm: steps, torchrun agents and workers forked from the warm servers (pipelines/local/warm_steps.py);
- cold: ``--cold``, every process a fresh interpreter, as on a cluster;
- cold with ``PYTHONPROFILEIMPORTTIME=1``: the seconds every process of each step (kfp's executor,
  torchrun agents and workers) spent importing (the sum of its top-level imports; importtime's own
  overhead makes these a little high), and the packages they went to (``heaviest_imports``): what
  the warm servers import once instead.

Each step's seconds come from the run's event file; "before the first step" is process start to
prepare's start (the parent's imports and, warm, the servers' imports it waits for); "training" is
the productive time the trainer measured (goodput). ``ratio`` is warm ÷ cold, measured side by side.

With ``RELAUNCH_BENCH_BASELINE=/path/to/another/checkout`` the warm run is also made with that source
tree first (``PYTHONPATH``) and the total row gets its wall time and ratio.

    make bench ARGS="pipeline"
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

from relaunch.pipelines.spec import STEP_TABLE

_TASK = re.compile(r"Executing task .*?'(?:\x1b\[[0-9;]*m)?([a-z-]+)")
_IMPORT = re.compile(r"import time:\s+\d+ \|\s+(\d+) \| (\S.*)$")


def _relaunch_run(steps: int, *, source: str | None = None, import_times: bool = False, cold: bool = False) -> dict:
    """One ``relaunch run`` in a fresh directory: wall and CPU seconds, its events and its log."""
    env = dict(os.environ)
    if source:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [source, env.get("PYTHONPATH")]))
    if import_times:
        env["PYTHONPROFILEIMPORTTIME"] = "1"
    command = [sys.executable, "-c", "import sys; from relaunch.pipelines.cli import main; sys.exit(main())",
               "run", "--set", f"train.max_steps={steps}", *(["--cold"] if cold else [])]
    with tempfile.TemporaryDirectory(prefix="bench-pipeline-") as tmp:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started, started_at = time.monotonic(), time.time()
        out = subprocess.run(command, cwd=tmp, capture_output=True, text=True, timeout=900, env=env)
        wall = time.monotonic() - started
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if out.returncode != 0:
            raise RuntimeError(f"relaunch run failed ({out.returncode}): {out.stderr[-500:]}")
        runs = Path(tmp, ".relaunch", "runs")
        events = [json.loads(line) for f in runs.rglob("events.jsonl") for line in f.read_text().splitlines()]
        log = "\n".join(f.read_text(errors="replace") for f in runs.rglob("pipeline.log"))
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    first = min((e["time"] for e in events if e["kind"] == "step-start"), default=started_at)
    return {"wall": wall, "cpu": cpu, "events": events, "log": log, "before_first_step": first - started_at}


def step_seconds(events: list[dict]) -> dict[str, tuple[float, float]]:
    """Step -> (seconds from its start to its end event, training seconds inside it)."""
    starts = {e["step"]: e["time"] for e in events if e["kind"] == "step-start"}
    out = {}
    for e in events:
        if e["kind"] == "step-end" and e["step"] in starts:
            training = float(e.get("outputs", {}).get("train_seconds", 0.0)) if e["step"] == "launch" else 0.0
            out[e["step"]] = (e["time"] - starts[e["step"]], training)
    return out


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


GOAL_TOTAL = "warm <= 10 s, cold <= 15 s"  # issue 18: `make run` back in a second, locally and on the cluster


def run(quick: bool) -> list[dict]:
    steps = 20 if quick else 120
    baseline_source = os.environ.get("RELAUNCH_BENCH_BASELINE")
    baseline = _relaunch_run(steps, source=baseline_source) if baseline_source else None
    warm = _relaunch_run(steps)
    cold = _relaunch_run(steps, cold=True)
    packages = package_import_seconds(_relaunch_run(steps, cold=True, import_times=True)["log"])
    warm_seconds, cold_seconds = step_seconds(warm["events"]), step_seconds(cold["events"])

    def row(name: str, warm_s: float, cold_s: float, imports: float = 0.0, training: float = 0.0,
            heaviest_imports: str = "", goal: str = "-") -> dict:
        return {"step": name, "warm_s": warm_s, "cold_s": cold_s, "ratio": warm_s / cold_s if cold_s else 0.0,
                "cold_imports_s": imports, "training_s": training, "heaviest_imports_cold": heaviest_imports,
                "goal": goal}

    rows = [row("before the first step", warm["before_first_step"], cold["before_first_step"])]
    for step in STEP_TABLE:
        if step in warm_seconds and step in cold_seconds:
            rows.append(row(step, warm_seconds[step][0], cold_seconds[step][0], sum(packages.get(step, {}).values()),
                            warm_seconds[step][1], heaviest(packages.get(step, {}))))

    def between(run: dict, seconds: dict) -> float:
        return run["wall"] - run["before_first_step"] - sum(v[0] for v in seconds.values())

    rows.append(row("between steps (kfp.local) and after the last", between(warm, warm_seconds),
                    between(cold, cold_seconds)))
    total = row(f"total relaunch run ({steps} steps), wall", warm["wall"], cold["wall"],
                sum(sum(p.values()) for p in packages.values()), sum(v[1] for v in warm_seconds.values()),
                goal=GOAL_TOTAL)
    if baseline:
        total.update(baseline_s=baseline["wall"], ratio_to_baseline=warm["wall"] / baseline["wall"])
    return rows + [total, row("total CPU seconds (all processes)", warm["cpu"], cold["cpu"])]
