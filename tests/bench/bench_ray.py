"""The Ray backend: MTTR of a killed worker beside torchrun's cold MTTR, and the Ray cluster's start-up share of make run.

In one run, the same 2-process CPU training (digits MLP, gloo, async checkpoints every ``BENCH_CHECKPOINT_EVERY`` s)
twice with one worker SIGKILLed every T s once the previous restart completed a step: through cold torchrun
(:func:`tests.bench.bench_training._training`, as ``make bench training`` measures it) and through the launch step
with ``launch.backend=ray`` (a local Ray head with token auth, one rank actor per rank re-executing relaunch's
trainer). MTTR is kill -> first completed step of the resumed attempt, from the trainer's own attempt records in
the store, the same reading for both. Goal (issue 29): the Ray backend's p50 <= 2 x torchrun's cold p50, far under
Ray Train's own ~19 s. Then ``relaunch run --set launch.backend=ray`` (what ``make run ARGS=...`` runs) once: its
wall time, the head's start-up (``ray start`` to accepting clients) and the driver's (``ray.init``, placement
group and rank actors), each as a share of the whole.

    make bench ARGS="ray"              # T = 20 s, 4 kills
    make bench ARGS="--quick ray"      # T = 6 s, 3 kills
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tests.bench.bench_training import _percentile, _recovered, _training, killed_trainings

ROOT = Path(__file__).resolve().parents[2]
GOAL_RATIO = 2.0  # Ray backend MTTR / torchrun cold MTTR
RAY_TRAIN_MTTR = 19.0  # s, Ray Train TorchTrainer, FailureConfig(max_failures=2), measured for issue 29


def _trainer_pids(marker: str) -> list[int]:
    """Running trainer processes whose command line holds ``marker`` (their store's path)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes()
                state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if b"relaunch.components.train" in cmdline and marker.encode() in cmdline and state != "Z":
                pids.append(int(proc.name))
    return pids


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_TRACKING_URI", "RELAUNCH_", "RAY_"))}
    env.update({"PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"})
    return env


def _ray_training(config: dict, workdir: Path, *, kill_every: float, kills: int) -> dict:
    """The launch step with ``launch.backend=ray`` to its end, a random trainer SIGKILLed every ``kill_every`` s."""
    from relaunch.components.core.store import open_store
    from relaunch.components.core.store import ledger

    rng = random.Random(0)
    store_root = Path(config["store"]["uri"])
    config = {**config, "launch": {"backend": "ray", "max_restarts": kills + 3}}
    log = workdir / "ray-killed.log"
    started = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "relaunch.components.launch", "--config-json", json.dumps(config),
                             "--input", "pipeline_run_id=bench-ray"], cwd=ROOT, env=_env(), stdout=log.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    kill_times: list[float] = []
    try:
        while proc.poll() is None:
            last = kill_times[-1] if kill_times else started
            if len(kill_times) < kills and time.time() - last >= kill_every and _recovered(store_root, last):
                workers = _trainer_pids(str(store_root))
                if len(workers) >= 2:
                    os.kill(rng.choice(workers), signal.SIGKILL)
                    kill_times.append(time.time())
            time.sleep(0.02)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    if proc.returncode != 0:
        raise RuntimeError(f"the Ray-backend training failed ({proc.returncode}); see {log}")
    attempts = ledger.load_attempts(open_store(str(store_root)))
    mttr = []
    for t in kill_times:
        after = [a for a in attempts if a.start > t and a.first_step_time]
        if after:
            mttr.append(after[0].first_step_time - t)
    return {"mttr": mttr, "kills": len(kill_times), "wall": time.time() - started}


def _make_run(workdir: Path, server_uri: str) -> dict:
    """``relaunch run --set launch.backend=ray`` once (the defaults' training): wall, head and driver start-up."""
    from relaunch.components.launchers.ray import ACTORS_READY, HEAD_UP

    state = workdir / "make-run-state"
    began = time.monotonic()
    done = subprocess.run([str(Path(sys.executable).parent / "relaunch"), "run", "--set", "launch.backend=ray",
                           "--set", f"store.uri={workdir / 'make-run-store'}", "--set", f"tracking.uri={server_uri}",
                           "--set", "tracking.experiment=bench-ray-make-run", "--state-dir", str(state)],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=1800)
    wall = time.monotonic() - began
    if done.returncode != 0:
        raise RuntimeError(f"relaunch run with launch.backend=ray failed ({done.returncode}): {done.stdout[-2000:]}")
    text = done.stdout + done.stderr + "".join(p.read_text(errors="replace") for p in state.rglob("*.log"))
    head = re.search(re.escape(HEAD_UP) + r" ([\d.]+) s", text)
    actors = re.search(re.escape(ACTORS_READY) + r" \d+ rank actors ready in ([\d.]+) s", text)
    return {"wall": wall, "head": float(head.group(1)) if head else float("nan"),
            "driver": float(actors.group(1)) if actors else float("nan")}


def run(quick: bool) -> list[dict]:
    with killed_trainings("bench-ray-", *((6.0, 3) if quick else (20.0, 4))) as bench:
        workdir, kill_every, kills = bench.workdir, bench.kill_every, bench.kills
        torchrun = _training(bench.config("torchrun-cold"), workdir, kill_every=kill_every, kills=kills, how="cold")
        ray = _ray_training(bench.config("ray"), workdir, kill_every=kill_every, kills=kills)
        make_run = _make_run(workdir, bench.tracking_uri)
    cold, on_ray = statistics.median(torchrun["mttr"]), statistics.median(ray["mttr"])
    return [
        {"metric": "MTTR, torchrun cold, p50 (s)", "value": cold, "goal": "-",
         "detail": f"p95 {_percentile(torchrun['mttr'], 0.95):.2f} s over {len(torchrun['mttr'])} kills, every {kill_every:g} s"},
        {"metric": "MTTR, Ray backend, p50 (s)", "value": on_ray, "goal": f"<= {GOAL_RATIO:g} x torchrun cold",
         "detail": f"p95 {_percentile(ray['mttr'], 0.95):.2f} s over {len(ray['mttr'])} kills; Ray Train's own: ~{RAY_TRAIN_MTTR:g} s"},
        {"metric": "MTTR Ray backend / torchrun cold (p50)", "value": on_ray / cold, "goal": f"<= {GOAL_RATIO:g}",
         "detail": json.dumps({"ray": [round(m, 2) for m in ray["mttr"]], "torchrun": [round(m, 2) for m in torchrun["mttr"]]})},
        {"metric": "make run with launch.backend=ray, wall (s)", "value": make_run["wall"], "goal": "-",
         "detail": "relaunch run --set launch.backend=ray, the default training"},
        {"metric": "Ray head start-up / make run", "value": make_run["head"] / make_run["wall"], "goal": "-",
         "detail": f"{make_run['head']:.1f} s: ray start --head to accepting clients"},
        {"metric": "Ray driver start-up / make run", "value": make_run["driver"] / make_run["wall"], "goal": "-",
         "detail": f"{make_run['driver']:.1f} s: ray.init, placement group, rank actors ready"},
    ]


if __name__ == "__main__":
    for row in run(quick="--quick" in sys.argv):
        print(row)
