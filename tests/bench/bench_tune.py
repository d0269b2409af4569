"""relaunch tune: the study machinery's overhead per trial, and the work a killed trial loses.

In one run, side by side:

1. ``by hand``: N trainings of the default task (the parameters a seeded study gives its first N trials,
   on the dataset it gives them), one after another, each the launch step called directly
   (``python -m relaunch.components.launch``, a store folder of its own and an MLflow run opened before it,
   as prepare opens a pipeline's); the N run before and again after the study, so that a drift of the
   machine cancels;
2. ``study``: ``relaunch tune`` of the same N trials, one at a time (``tune.parallel=1``, no pruner), from
   its first trial's start to its last trial's end (prepare before and evaluate/register after are not
   trials); the difference per trial with the by-hand mean;
3. the machinery alone, in this process: a trial begun and ended (Optuna asked and told, its MLflow
   child run opened and closed, its folder, dataset and records written) without a training between,
   plus half of the study loop's poll (a trial's end is seen within one). Goal (issue 28): <= 2 % of a
   trial's wall time;
4. ``killed trial``: a 1-trial study whose worker is SIGKILLed at a random moment after its first
   checkpoint; torchrun restarts it and it resumes. Work lost = the time from the commit of the
   checkpoint it resumed from to the kill (the MANIFEST's mtime: an upper bound, it commits after its
   step), in seconds and in steps. Goal: <= one checkpoint interval.

    make bench ARGS="tune"            # N = 4 trainings of 80 steps
    make bench ARGS="--quick tune"    # N = 2 trainings of 40 steps
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from relaunch.pipelines.tune.trial_runner import POLL_SECONDS

ROOT = Path(__file__).resolve().parents[2]
RELAUNCH = str(Path(sys.executable).parent / "relaunch")
CHECKPOINT_EVERY = 10
STEP_SLEEP = 0.1
GOAL_OVERHEAD = 0.02


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_TRACKING_URI", "RELAUNCH_"))}
    env.update({"PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"})
    return env


def _study_args(workdir: Path, steps: int, trials: int) -> list[str]:
    return ["--config", str(ROOT / "configs" / "tune.yaml"), "--set", f"store.uri={workdir / 'store'}",
            "--set", f"tracking.uri=sqlite:///{workdir / 'mlflow.db'}",
            "--set", f"tracking.artifact_location={workdir / 'mlartifacts'}",
            "--set", f"train.max_steps={steps}", "--set", f"train.checkpoint_every_steps={CHECKPOINT_EVERY}",
            "--set", f"train.step_sleep_seconds={STEP_SLEEP}", "--set", "tune.pruner.name=none",
            "--set", f"tune.trials={trials}", "--set", "tune.parallel=1", "--set", "launch.rdzv_port=0"]


def _trial_params(trials: int) -> list[dict]:
    """The parameters a fresh study of ``configs/tune.yaml`` (seed 0) gives its first ``trials`` trials."""
    from relaunch.components.core.contract.config_loading import load_config
    from relaunch.components.core.tuning.study import Study

    with tempfile.TemporaryDirectory() as tmp:
        config = load_config(ROOT / "configs" / "tune.yaml", ["tune.study=bench"])
        study = Study(config, f"sqlite:///{tmp}/optuna.db")
        return [study.ask(n)[1] for n in range(trials)]


def _by_hand(workdir: Path, params: list[dict], steps: int, series: str) -> list[float]:
    """Each training through the launch step, one after another, on the dataset a study gives its
    trials (stored beside it, ``data.version`` set); their wall times."""
    from relaunch.components.core.contract.config_loading import load_config
    from relaunch.components.core.contract.suggestions import apply_suggestions
    from relaunch.components.core.store import open_store
    from relaunch.components.core.data import commit_task_data
    from relaunch.components.core.tracking.client import ensure_run
    from relaunch.components.tasks.base import load_task

    walls = []
    for n, values in enumerate(params):
        store_uri = workdir / f"hand-{series}" / str(n)
        config = load_config(ROOT / "configs" / "tune.yaml", [
            f"store.uri={store_uri}", f"tracking.uri=sqlite:///{workdir / 'hand.db'}",
            f"tracking.artifact_location={workdir / 'hand-art'}", f"train.max_steps={steps}",
            f"train.checkpoint_every_steps={CHECKPOINT_EVERY}", f"train.step_sleep_seconds={STEP_SLEEP}"])
        config = apply_suggestions(config, values)
        config.data.version = commit_task_data(load_task(config.train.task, config), open_store(str(store_uri)))[0].version
        config.tracking.run_id = ensure_run(config)  # as prepare opens a pipeline's run before its launch step
        env = {**_env(), "RELAUNCH_EVENTS": str(store_uri / "events.jsonl")}  # as a trial's: no progress printed
        began = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "relaunch.components.launch", "--config-json", config.to_json()],
                              cwd=workdir, env=env, capture_output=True, text=True, timeout=600)
        walls.append(time.monotonic() - began)
        print(f"bench_tune: by hand, {series} {n}: {walls[-1]:.2f}s", file=sys.stderr)
        if done.returncode != 0:
            raise RuntimeError(f"by-hand training {n} failed: {done.stderr[-500:]}")
    return walls


def _machinery(workdir: Path, trials: int) -> float:
    """Seconds per trial of the study machinery alone, in this process: a trial begun (Optuna asked, its
    MLflow child run opened, its folder given its configuration and the dataset, its record written) and
    ended (Optuna told, its record written, its MLflow run closed), without a training between."""
    from relaunch.components import prepare
    from relaunch.components.core.contract.config import RelaunchConfig
    from relaunch.components.core.contract.config_loading import load_config
    from relaunch.components.core.store import open_store
    from relaunch.components.core.tuning.study_folder import COMPLETE, study_uri
    from relaunch.components.core.tuning.study import Study
    from relaunch.components.core.tuning.trials import begin_trial, end_trial

    uri = study_uri(str(workdir / "machinery"), "alone")
    config = load_config(ROOT / "configs" / "tune.yaml", [
        f"store.uri={uri}", f"tracking.uri=sqlite:///{workdir / 'machinery.db'}", "tune.study=alone",
        f"tracking.artifact_location={workdir / 'machinery-art'}", f"tune.trials={trials + 1}"])
    prepared = RelaunchConfig.from_json(prepare.run(config).config_json)
    study = Study(prepared, f"sqlite:///{workdir / 'machinery-optuna.db'}")
    store = open_store(uri)
    end_trial(study, begin_trial(study, prepared, store, 0, parent_run_id=prepared.tracking.run_id), store,
              state=COMPLETE, value=1.0, step=1)  # the first pays for imports and connections
    began = time.perf_counter()
    for n in range(1, trials + 1):
        started = begin_trial(study, prepared, store, n, parent_run_id=prepared.tracking.run_id)
        end_trial(study, started, store, state=COMPLETE, value=float(n), step=1)
    return (time.perf_counter() - began) / trials


def _study(workdir: Path, trials: int, steps: int, name: str) -> tuple[list[dict], float]:
    """``relaunch tune`` to its end; its trial records and its wall time."""
    began = time.monotonic()
    done = subprocess.run([RELAUNCH, "tune", *_study_args(workdir, steps, trials), "--study", name], cwd=workdir,
                          env=_env(), capture_output=True, text=True, timeout=1200)
    wall = time.monotonic() - began
    if done.returncode != 0:
        raise RuntimeError(f"relaunch tune failed: {done.stderr[-500:]}")
    folder = workdir / "store" / "studies" / name / "trials"
    records = [json.loads((folder / str(n) / "trial.json").read_text()) for n in range(trials)]
    for r in records:
        print(f"bench_tune: study trial {r['number']}: {r['ended'] - r['started']:.2f}s", file=sys.stderr)
    return records, wall


def _worker(trial: Path):
    import psutil

    for p in psutil.process_iter():
        try:
            command = " ".join(p.cmdline())
            if (p.environ().get("RELAUNCH_METRICS_FILE", "").startswith(str(trial) + "/")
                    and "-m relaunch.components.train" in command and "torch.distributed.run" not in command):
                return p
        except psutil.Error:
            pass
    return None


def _killed_trial(workdir: Path, steps: int) -> dict:
    """A 1-trial study whose worker is SIGKILLed at a random moment after its first checkpoint; the work
    lost: the time from the commit of the checkpoint it resumed from to the kill, in seconds and steps."""
    name = "killed"
    trial = workdir / "store" / "studies" / name / "trials" / "0"
    proc = subprocess.Popen([RELAUNCH, "tune", *_study_args(workdir, steps, 1), "--study", name], cwd=workdir,
                            env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline, kill_at, killed = time.monotonic() + 600, None, None
    while proc.poll() is None and time.monotonic() < deadline and killed is None:
        try:
            committed = json.loads((trial / "checkpoints" / "latest.json").read_text())["step"]
        except (OSError, ValueError):
            committed = -1
        if committed >= CHECKPOINT_EVERY and kill_at is None:
            kill_at = time.monotonic() + random.Random(0).uniform(0, CHECKPOINT_EVERY * STEP_SLEEP)
        if kill_at is not None and time.monotonic() >= kill_at:
            worker = _worker(trial)
            manifest = trial / "checkpoints" / f"step-{committed:012d}" / "MANIFEST.json"
            if worker is not None:
                committed_at = manifest.stat().st_mtime
                worker.send_signal(signal.SIGKILL)
                killed = (committed, time.time() - committed_at)
        time.sleep(0.02)
    _, err = proc.communicate(timeout=600)
    if proc.returncode != 0 or killed is None:
        raise RuntimeError(f"the killed-trial study failed (exit {proc.returncode}, killed {killed}): {err[-500:]}")
    summary = json.loads((trial / "runs" / "summary.json").read_text())
    resumed = [s for s in summary["resumed_from_steps"] if s >= 0][0]
    step_seconds = summary["train_seconds"] / max(1, summary["last_step"] - max(0, summary["resumed_from_steps"][-1]))
    committed, lost_seconds = killed
    return {"resumed_from": resumed, "committed_at_kill": committed, "lost_seconds": lost_seconds,
            "lost_steps": lost_seconds / step_seconds, "interval_seconds": CHECKPOINT_EVERY * step_seconds}


def run(quick: bool = False) -> list[dict]:
    trials, steps = (2, 40) if quick else (4, 80)
    with tempfile.TemporaryDirectory(prefix="bench-tune-") as tmp:
        workdir = Path(tmp)
        params = _trial_params(trials)
        _by_hand(workdir, params[:1], 10, "warm-up")  # the page cache and the first imports
        hand = _by_hand(workdir, params, steps, "before")
        records, study_wall = _study(workdir, trials, steps, "overhead")
        hand += _by_hand(workdir, params, steps, "after")  # before and after: a drift of the machine cancels
        machinery = _machinery(workdir, trials)
        span = max(r["ended"] for r in records) - min(r["started"] for r in records)
        mean_hand = sum(hand) / len(hand)
        per_trial = span / trials - mean_hand
        kill = _killed_trial(workdir, steps)
    own = machinery + POLL_SECONDS / 2  # a trial's end is seen within one poll of the study's loop
    return [
        {"measure": f"trial wall, by hand (launch step; mean of {len(hand)})", "value": round(mean_hand, 2),
         "unit": "s", "goal": "", "verdict": ""},
        {"measure": "trial wall, in the study (its trials' span / N)", "value": round(span / trials, 2), "unit": "s",
         "goal": "", "verdict": ""},
        {"measure": "difference per trial (study - by hand)", "value": round(per_trial, 3), "unit": "s",
         "goal": f"<= {GOAL_OVERHEAD * mean_hand:.2f} s", "verdict": _verdict(per_trial <= GOAL_OVERHEAD * mean_hand)},
        {"measure": "machinery per trial (begin + end, in process) + half a poll", "value": round(own, 3), "unit": "s",
         "goal": f"<= {GOAL_OVERHEAD * mean_hand:.2f} s", "verdict": _verdict(own <= GOAL_OVERHEAD * mean_hand)},
        {"measure": "machinery / trial wall", "value": round(own / mean_hand, 4), "unit": "ratio",
         "goal": f"<= {GOAL_OVERHEAD}", "verdict": _verdict(own / mean_hand <= GOAL_OVERHEAD)},
        {"measure": "whole study (prepare, trials, evaluate, register)", "value": round(study_wall, 1), "unit": "s",
         "goal": "", "verdict": ""},
        {"measure": f"killed trial: resumed from step (committed at the kill: {kill['committed_at_kill']})",
         "value": kill["resumed_from"], "unit": "step", "goal": "the checkpoint committed at the kill",
         "verdict": _verdict(kill["resumed_from"] == kill["committed_at_kill"])},
        {"measure": "killed trial: work lost (kill - commit of that checkpoint)", "value": round(kill["lost_seconds"], 2),
         "unit": "s", "goal": f"<= {kill['interval_seconds']:.2f} s (one interval)",
         "verdict": _verdict(kill["lost_seconds"] <= kill["interval_seconds"])},
        {"measure": "killed trial: steps lost", "value": round(kill["lost_steps"], 1), "unit": "steps",
         "goal": f"<= {CHECKPOINT_EVERY} (one interval)", "verdict": _verdict(kill["lost_steps"] <= CHECKPOINT_EVERY)},
    ]


def _verdict(met: bool) -> str:
    return "met" if met else "missed"
