"""A worker's start-up path: what it imports before its first step, and what starts after it.

Real worker processes (``python -m relaunch.components.train``, a world of one) against the session's real
MLflow server; the import order comes from the interpreter's own ``-X importtime`` lines, which it
writes to the same pipe as the worker's events, in order.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from relaunch.components.core.contract import events
from tests.train.conftest import ROOT, train_config

# What the first step of a restarted worker does not need: each loads after it, off the training thread.
DEFERRED = ("mlflow", "matplotlib", "psutil", "pandas", "sqlalchemy")
# Modules a cold worker avoids altogether before its first step (np.unique imports numpy.ma).
AVOIDED = ("numpy.ma",)


def _worker(config: dict, *, importtime: bool = False, env: dict | None = None) -> list[str]:
    """Run one world-of-one worker to its end; its stdout and stderr lines, interleaved as written."""
    child_env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "RELAUNCH_"))}
    child_env.update({"PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", **(env or {})})
    argv = [sys.executable, *(["-X", "importtime"] if importtime else []), "-m", "relaunch.components.train",
            "--config-json", json.dumps(config)]
    proc = subprocess.run(argv, cwd=ROOT, env=child_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return proc.stdout.splitlines()


def _with_run(config: dict) -> dict:
    """The config with its MLflow run made beforehand, as the pipeline's launch step passes it (a
    restarted worker finds the run id in the store: neither creates a run before the first step)."""
    from relaunch.components.core.contract.config import RelaunchConfig
    from relaunch.components.core.tracking.client import ensure_run

    config["tracking"]["run_id"] = ensure_run(RelaunchConfig.model_validate(config))
    return config


def _imported(lines: list[str]) -> set[str]:
    """The top-level package of every module an ``-X importtime`` line among ``lines`` names."""
    found = set()
    for line in lines:
        match = re.match(r"import time:\s+\d+ \|\s+\d+ \|\s*(\S+)$", line)
        if match:
            found.add(match.group(1).split(".")[0])
    return found


# A ``sitecustomize`` the worker's interpreter imports at start-up: a line for each garbage collection,
# saying whether torch was imported by then (whatever ran before train.py's first line does not count).
GC_HOOK = """import gc, sys
gc.callbacks.append(lambda phase, info: phase == "start" and print(
    f"gc-collection: generation {info['generation']}, torch imported: {'torch' in sys.modules}", flush=True))
"""


@pytest.fixture(scope="module")
def worker(tmp_path_factory, mlflow_server) -> tuple[dict, list[str]]:
    """One world-of-one training the tests below only read: its config and its output lines, with the
    interpreter's ``-X importtime`` lines and a line for each garbage collection among them; 6 s or
    more of steps, so that system metrics are sampled at the default interval."""
    hook = tmp_path_factory.mktemp("gc-hook")
    (hook / "sitecustomize.py").write_text(GC_HOOK)
    config = _with_run(train_config(tmp_path_factory.mktemp("startup"), mlflow_server.uri, max_steps=40,
                                    checkpoint_every_steps=20, step_sleep_seconds=0.15))
    return config, _worker(config, importtime=True, env={"PYTHONPATH": f"{hook}{os.pathsep}{ROOT}"})


def _first_step(lines: list[str]) -> int:
    """The index of the first-step event among ``lines``."""
    first = next((i for i, line in enumerate(lines)
                  if (e := events.read(line)) is not None and e.kind == events.Kind.FIRST_STEP), None)
    assert first is not None, "no first-step event:\n" + "\n".join(lines[-40:])
    return first


def test_a_worker_imports_no_mlflow_matplotlib_or_psutil_before_its_first_step(worker):
    _, lines = worker
    first = _first_step(lines)
    before, after = _imported(lines[:first]), _imported(lines[first:])
    assert "torch" in before
    assert not before & set(DEFERRED), f"imported before the first step: {sorted(before & set(DEFERRED))}"
    assert not _modules(lines[:first]) & set(AVOIDED)
    assert {"mlflow", "psutil"} <= after  # the logger and the sampler did start, after it


def _modules(lines: list[str]) -> set[str]:
    """Every module an ``-X importtime`` line among ``lines`` names."""
    return {m.group(1) for line in lines if (m := re.match(r"import time:\s+\d+ \|\s+\d+ \|\s*(\S+)$", line))}


def test_the_zygote_preloads_every_module_a_worker_imports_before_its_first_step(worker):
    """A warm worker imports nothing before its first step: whatever a cold one imports, the zygote's
    preload (and its optimiser warm-up, which imports torch._dynamo) already did."""
    _, lines = worker
    first = _first_step(lines)
    # what the preload lacks and imports (-X importtime also lists the optional imports that failed)
    probe = ("import importlib, json, sys; from relaunch.components.core.runtime import zygote as z; "
             "z.preload_modules([*z.PRELOAD, 'relaunch.components.train', 'relaunch.components.tasks.digits']); have = set(sys.modules); "
             "needed = json.loads(sys.stdin.read()); missing = []\n"
             "for name in needed:\n"
             "    try:\n"
             "        importlib.import_module(name)\n"
             "    except Exception:\n"
             "        continue\n"
             "    if name not in have:\n"
             "        missing.append(name)\n"
             "print(json.dumps({'dynamo': 'torch._dynamo' in have, 'missing': missing}))")
    needed = sorted(_modules(lines[:first]))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OPENBLAS_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, input=json.dumps(needed),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    found = json.loads(out.stdout.splitlines()[-1])
    assert "torch._dynamo" in needed and found["dynamo"]
    assert not found["missing"], f"a forked worker would still import: {found['missing']}"


def test_a_cold_worker_collects_no_garbage_from_importing_torch_to_its_first_step_and_does_after(worker):
    _, lines = worker
    first = _first_step(lines)
    collections = [(i, line) for i, line in enumerate(lines) if line.startswith("gc-collection:")]
    assert not [line for i, line in collections if i < first and line.endswith("torch imported: True")]
    assert [line for i, line in collections if i > first], "the collector did not run again after the first step"


def test_the_first_step_event_carries_the_start_up_phases_in_order(worker):
    _, lines = worker
    found = [e for e in map(events.read, lines) if e is not None and e.kind == events.Kind.FIRST_STEP]
    assert len(found) == 1 and found[0]["step"] == 1 and found[0]["attempt"] == 1
    phases = found[0]["phases"]
    order = ["imports", "process_group", "data", "build", "resume", "first_step"]
    assert [phases[p] for p in order] == sorted(phases[p] for p in order) and phases["exec"] >= 0


def test_the_attempt_record_keeps_the_loop_start_it_writes_with_the_first_step(worker):
    from relaunch.components.core.store import open_store
    from relaunch.components.core.store import ledger

    config, _ = worker
    [attempt] = ledger.load_attempts(open_store(config["store"]["uri"]))
    assert attempt.start <= attempt.loop_start <= attempt.first_step_time
    assert attempt.phases["resume"] <= attempt.loop_start - attempt.start


def test_system_metrics_are_sampled_through_a_short_training(worker, mlflow_server):
    from mlflow.tracking import MlflowClient

    config, _ = worker
    client = MlflowClient(mlflow_server.uri)
    cpu = client.get_metric_history(config["tracking"]["run_id"], "system/node-0/cpu_utilization_percentage")
    assert len(cpu) > 1, [(m.step, m.value) for m in cpu]
    assert max(m.value for m in cpu) > 0
    memory = client.get_metric_history(config["tracking"]["run_id"], "system/node-0/process_memory_rss_megabytes")
    assert memory and min(m.value for m in memory) > 0
