"""Training under fire: ETTR with a SIGKILL every T s, MTTR and where it goes, and MLflow logging overhead per step.

Side by side in one run: the same 2-process CPU training (torchrun, gloo, digits MLP, async
checkpoints every few seconds) once undisturbed and once with one worker SIGKILLed every T seconds
(torchrun restarts the group; the trainer resumes from the latest committed checkpoint), each pair
twice: cold (torchrun's workers are fresh interpreters) and warm (its workers are the zygote client,
``--no-python python -I -S zygote_client.py``, and each worker a fork of a zygote the bench starts
first, as a pod's supervisor does; the SIGKILL hits the forked worker itself); and twice more with
recovery from memory (``train.memory_tier``, issue 30): the in-place agent replaces only the killed
worker, the survivor keeps its process and restores from its own snapshot, the replacement from its
peer's replica ("inplace": the replacement a fresh interpreter; "inplace-warm": a fork of the zygote).
For those, MTTR is kill -> the first step after the recovery (the attempt record's ``in_place`` entry,
or a new attempt's first step when rank 0 was the one killed). ``BENCH_HOWS`` picks a subset
(e.g. ``inplace,inplace-warm``). ETTR is
the trainer's own goodput report (productive time / wall time, from its per-attempt records in the
store), projected to a kill every 60 s twice: against the undisturbed run as measured (its first start
included) and for a training long enough to amortise its first start; ``wall ratio`` is the undisturbed wall time over the disturbed one for the same work. MTTR is
kill -> first completed step of the resumed attempt. The logging overhead is measured in-process:
the same training step loop with and without ``RunLogger.log_metrics`` feeding a real ``mlflow
server``, plus the logger's own main-thread time per call.

MTTR is broken into phases, per restart (p50 and p95 of each over the kills): detection (kill ->
the last worker of the old group gone: torchrun noticing and stopping the survivors, polled every
20 ms), rendezvous (-> the new rank 0 process created: torchrun's re-rendezvous and spawn), process
start + imports (-> its imports done), process-group init, task + data, model + optimiser (DDP's
first broadcast; torch.optim imports torch._dynamo), lease + checkpoint load, first step (-> the first step of the
resumed attempt done). The worker records its phases in its attempt record
(:class:`relaunch.components.core.store.ledger.Attempt`); the floor is a fresh interpreter importing
torch and torch.distributed, timed before and after each training (the load drifts). torchrun's
``--monitor-interval`` is what the launch renders (``launch.monitor_interval_seconds``) unless
``BENCH_MONITOR_INTERVAL`` says otherwise. The ETTR rows carry the goodput categories;
both breakdowns are drawn into ``bench-results/training-breakdown.png`` (copied to
``docs/training-breakdown.png`` for docs/benchmarks.md).

A kill comes T s after the previous one, once the resumed attempt has completed a step (a kill
never lands inside a recovery). Checkpoints: async, every ``BENCH_CHECKPOINT_EVERY`` s (default 1 s:
the Young/Daly interval sqrt(2 x stall per save x time between failures) for this training's 4-7 ms
stall per save and a kill every 60 s is 0.7-0.9 s; a training that checkpoints every T_c loses T_c / 2
of recomputed work per kill on average). The in-place trainings keep a snapshot in memory every
``BENCH_SNAPSHOT_EVERY`` steps (default 4: each costs the training's thread ~70 us, counted as checkpoint
stall, half of it numpy's RNG state; Young/Daly for that and a kill a minute is ~90 ms, 4 of these 24 ms
steps) and commit to
the store every ``BENCH_CHECKPOINT_EVERY_INPLACE`` s (default 30: the store serves only a whole group's
loss then). Of the two ETTR rows at 60 s, the first counts the undisturbed
run's first start (~1 s), which weighs 2 % in the quick mode's 52 s and 0.3 % in the full mode's 6
minutes; the second amortises it and the final save (a wait for the last commit, ~0.1 s, once per
training), taking the undisturbed run's loss between the two as its steady loss. The logging rows: the trainer's own
measure on rank 0 of the undisturbed run (caller time + the sender thread's CPU per step, over the
step time without the demo sleep), and the same logger against a bare in-process digits step. Full mode: T = 60 s, 5 kills (about 15 minutes). Quick mode scales T
down to 8 s (5 kills): the restart cost is then a much larger share of each interval, so its ETTR is
far below the 60 s one; the row "ETTR projected to a kill every 60 s" puts the measured lost time per
kill against 60 s. ``BENCH_KILL_EVERY`` and ``BENCH_KILLS`` override T and the number of kills.

    make bench ARGS="training"              # full: the lead's quiet run
    make bench ARGS="--quick training"      # short: T = 8 s
    BENCH_KILL_EVERY=10 BENCH_KILLS=3 make bench ARGS="--quick training"
    BENCH_MONITOR_INTERVAL=0.1 make bench ARGS="--quick training"
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
RDZV_CONF = "join_timeout=30,last_call_timeout=1,close_timeout=2"
MONITOR_INTERVAL = float(os.environ.get("BENCH_MONITOR_INTERVAL", 0) or 0) or None
CHECKPOINT_EVERY = float(os.environ.get("BENCH_CHECKPOINT_EVERY", 1.0))  # s; see the module doc
"""torchrun's --monitor-interval: what the launch renders (``launch.monitor_interval_seconds``) unless set."""
SNAPSHOT_EVERY = int(os.environ.get("BENCH_SNAPSHOT_EVERY", 4))  # steps; see the module doc
CHECKPOINT_EVERY_INPLACE = float(os.environ.get("BENCH_CHECKPOINT_EVERY_INPLACE", 30.0))  # s; see the module doc
FIGURE = Path("bench-results") / "training-breakdown.png"

# issue 18's goals (measured side by side in one run on 2 cores)
GOAL_MTTR_WARM = 1.0  # s, p95, a warm restart
GOAL_COLD_OVER_FLOOR = 2.0  # p95 of a cold restart over the floor (fresh interpreter importing torch + torch.distributed)
GOAL_ETTR = 0.97  # with a SIGKILL every 60 s
# issue 30's goals: recovery from memory
GOAL_MTTR_INPLACE_WARM = 0.3  # s, p95, the replacement a warm fork
GOAL_INPLACE_COLD_OVER_FLOOR = 1.0  # p95 over the floor, the replacement a fresh interpreter
GOAL_ETTR_INPLACE = 0.995  # with a SIGKILL every 60 s
HOWS = tuple(os.environ.get("BENCH_HOWS", "cold,warm,inplace,inplace-warm").split(","))
GOAL_LOGGING = 0.01  # MLflow logging / step time on rank 0

PHASES = ("detection", "rendezvous", "process start + imports", "process-group init", "task + data",
          "model + optimiser", "lease + checkpoint load", "first step")


def _children(pid: int, marker: bytes | None = b"relaunch.components.train") -> list[int]:
    """The worker processes among ``pid``'s children: torchrun's children running relaunch.components.train
    (cold), or every child of the zygote (warm: its forks are the workers, torchrun's are their clients)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            continue
        for child in children:
            try:
                if marker is None or marker in Path(f"/proc/{child}/cmdline").read_bytes():
                    out.append(child)
            except OSError:
                continue
    return out


def monitor_interval() -> float:
    from relaunch.components.core.contract.config import LaunchConfig

    return MONITOR_INTERVAL or LaunchConfig().monitor_interval_seconds


def _torchrun_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_TRACKING_URI", "RELAUNCH_"))}
    env.update({"PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"})
    return env


def _torchrun(config: dict, log: Path, max_restarts: int, env: dict[str, str], worker: list[str]) -> subprocess.Popen:
    """torchrun as the launch renders it, its workers ``python -u -m relaunch.components.train`` (cold) or the
    zygote client's ``--no-python python -I -S client.py -m relaunch.components.train`` (warm, ``worker``)."""
    from tests.services import free_port

    argv = [str(BIN / "torchrun"), "--nnodes=1", "--nproc-per-node=2", f"--max-restarts={max_restarts}",
            f"--monitor-interval={monitor_interval():g}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
            f"--rdzv-id={uuid.uuid4().hex[:8]}", f"--rdzv-conf={RDZV_CONF}", "--shutdown-timeout=10",
            *(("--no-python", *worker) if worker else ()), "-m", "relaunch.components.train", "--config-json", json.dumps(config)]
    return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def _inplace_agent(config: dict, log: Path, max_restarts: int, env: dict[str, str], warm: bool) -> subprocess.Popen:
    """The in-place agent as the local launch renders it for ``train.memory_tier`` on one node."""
    config = {**config, "train": {**config["train"], "memory_tier": True, "memory_snapshot_every_steps": SNAPSHOT_EVERY,
                                  "checkpoint_every_seconds": CHECKPOINT_EVERY_INPLACE}}
    argv = [sys.executable, "-m", "relaunch.components.launchers.inplace", "--nproc-per-node=2",
            f"--max-restarts={max_restarts}", *(("--warm",) if warm else ()),
            "-m", "relaunch.components.train", "--config-json", json.dumps(config)]
    return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def _training(config: dict, workdir: Path, *, kill_every: float | None, kills: int, how: str = "cold") -> dict:
    """One training to its end, SIGKILLing a random worker every ``kill_every`` s once the previous
    restart completed a step. ``warm``: the workers are forks of a zygote the bench starts first, as a
    pod's supervisor does (:func:`relaunch.components.core.runtime.zygote.for_command`), and the kill hits the
    forked worker itself (what the OOM killer would hit), not its client."""
    from relaunch.components.core.runtime.zygote import Zygote, client_command
    from relaunch.components.core.store import open_store, records
    from relaunch.components.core.store import ledger
    from relaunch.components.core.tracking import goodput

    rng = random.Random(0)
    store_root = Path(config["store"]["uri"])
    warm, in_place = how.endswith("warm"), how.startswith("inplace")
    name = f"{how}-{'killed' if kill_every else 'plain'}"
    log = workdir / f"{name}.log"
    env = _torchrun_env()
    started = time.time()
    zygote = None
    if warm:
        zygote = Zygote(str(workdir / f"{name}.sock"), ("relaunch.components.tasks.digits",), log=(workdir / f"{name}.zygote.log").open("w"),
                        env=env, cwd=str(ROOT))
        env = {**env, **zygote.env}
    try:
        proc = (_inplace_agent(config, log, kills + 3, env, warm) if in_place
                else _torchrun(config, log, kills + 3, env, client_command() if warm else []))
        kill_times: list[float] = []
        gone_times: list[float] = []  # when the last worker of the killed group was gone
        old: list[int] = []
        while proc.poll() is None:
            last = kill_times[-1] if kill_times else started
            if old and not any(_alive(pid) for pid in old):
                gone_times.append(time.time())
                old = []
            if kill_every and len(kill_times) < kills and time.time() - last >= kill_every and _recovered(store_root, last):
                workers = _children(zygote.process.pid, None) if zygote else _children(proc.pid)
                if workers:
                    os.kill(rng.choice(workers), signal.SIGKILL)
                    kill_times.append(time.time())
                    old = workers
            time.sleep(0.02)
        wall = time.time() - started
    finally:
        if zygote is not None:
            zygote.close()
    if proc.returncode != 0:
        raise RuntimeError(f"training failed ({proc.returncode}); see {log}")
    store = open_store(config["store"]["uri"])
    attempts = ledger.load_attempts(store)
    report = goodput.goodput_report(attempts)
    mttr, breakdowns = [], []
    for i, t in enumerate(kill_times):
        after = [a for a in attempts if a.start > t and a.first_step_time]
        kept = sorted(r["first_step_time"] for a in attempts for r in a.in_place
                      if r["lost_at"] > t and r.get("first_step_time"))
        if kept and (not after or kept[0] < after[0].first_step_time):  # the survivors went on: no new attempt
            mttr.append(kept[0] - t)
        elif after:
            mttr.append(after[0].first_step_time - t)
            gone = next((g for g in gone_times if g >= t), None)
            breakdowns.append(restart_phases(t, gone, after[0]))
    summary = records.read_summary(store) or {}
    cold_starts = log.read_text(errors="replace").count("starting the worker cold") if warm else 0
    return {"name": name, "wall": wall, "report": report, "kills": len(kill_times), "mttr": mttr,
            "final_save": final_save_seconds(attempts[-1]) if attempts else 0.0,
            "attempts": len(attempts), "phases": breakdowns, "cold_starts": cold_starts,
            "tracking": summary.get("goodput", {}).get("tracking_overhead", {})}


def restart_phases(killed: float, gone: float | None, attempt) -> dict[str, float]:
    """One restart's MTTR in :data:`PHASES` (seconds; they add up to kill -> first resumed step)."""
    p = attempt.phases
    created = attempt.created or attempt.start
    gone = min(max(gone if gone is not None else created, killed), created)
    offsets = [p.get(name, 0.0) for name in ("imports", "process_group", "data", "build", "resume")]
    offsets[2] = offsets[2] or offsets[1]  # a record without the data phase: all of it is the model's
    marks = [killed, gone, created, *(attempt.start + o for o in offsets), attempt.first_step_time]
    return {name: max(0.0, marks[i + 1] - marks[i]) for i, name in enumerate(PHASES)}


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie waiting for torchrun to reap it does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def import_floor(times: int) -> list[float]:
    """Wall seconds of a fresh interpreter importing torch and torch.distributed (the cold floor)."""
    out = []
    for _ in range(times):
        began = time.monotonic()
        subprocess.run([sys.executable, "-c", "import torch, torch.distributed"], check=True)
        out.append(time.monotonic() - began)
    return out


def _recovered(store_root: Path, since: float) -> bool:
    """Whether an attempt completed a step after ``since`` (a kill never lands inside a recovery)."""
    for path in (store_root / "runs" / "attempts").glob("*.json"):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if (record.get("first_step_time") or 0) > since:
            return True
        if any((r.get("first_step_time") or 0) > since for r in record.get("in_place", [])):
            return True
    return False


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def _logging_overhead(tracking_uri: str, steps: int) -> dict:
    """Step time of the digits training loop with and without per-step MLflow logging (same process)."""
    import torch

    from relaunch.components.core.contract.config import RelaunchConfig
    from relaunch.components.core.tracking.runlogger import RunLogger
    from relaunch.components.core.tracking.client import ensure_run
    from relaunch.components.tasks.digits import make_task

    config = RelaunchConfig.model_validate({"tracking": {"uri": tracking_uri, "experiment": "bench-logging"}})
    task = make_task(config)
    split = task.build_splits()["train"]
    x, y = torch.from_numpy(split["x"]), torch.from_numpy(split["y"])
    run_id = ensure_run(config)
    logger = RunLogger(tracking_uri, run_id)
    logger.log_metrics({"warm-up": 0.0}, 0)
    logger.flush(30)  # mlflow imported and connected before timing
    cpu_before = logger.stats.sender_cpu_seconds

    offset = 0

    torch.set_num_threads(1)  # as torchrun sets OMP_NUM_THREADS=1 for each worker

    def loop(log: bool) -> float:
        nonlocal offset
        torch.manual_seed(0)
        model = task.build_model()
        optimizer = task.build_optimizer(model)
        began = time.thread_time()  # CPU time: the box is shared, wall time would measure the neighbours
        for step in range(steps):
            idx = torch.arange(step * 64, step * 64 + 64) % len(x)
            loss = task.loss(model, {"x": x[idx], "y": y[idx]})
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            value = float(loss)
            if log:
                logger.log_metrics({"train/loss": value, "train/lr": 0.05, "train/grad_norm": 1.0,
                                    "train/step_seconds": 0.001, "train/samples_per_second": 64000.0}, step + offset)
        elapsed = (time.thread_time() - began) / steps
        if log:
            offset += steps
            logger.flush(60)  # what was sent belongs to this round's time, not the next one's
        return elapsed

    rounds = []
    for i in range(5):  # interleaved, order alternating, so load drift hits both alike
        if i % 2:
            logged = loop(True)
            rounds.append((loop(False), logged))
        else:
            rounds.append((loop(False), loop(True)))
    logger.close(60)
    plain = statistics.median(r[0] for r in rounds)
    logged = statistics.median(r[1] for r in rounds)
    logged_steps = steps * len(rounds)
    return {"step_seconds": plain, "logged_step_seconds": logged,
            "sender_cpu_seconds_per_step": (logger.stats.sender_cpu_seconds - cpu_before) / logged_steps,
            "main_thread_seconds_per_call": logger.stats.main_thread_seconds / max(1, logger.stats.calls),
            "points_sent": logger.stats.points_sent}


def how_of(run: dict) -> str:
    """How a training of the bench restarts ("cold", "warm", "inplace", "inplace-warm"), from its name."""
    return run["name"].rsplit("-", 1)[0]


def plot_breakdown(killed: list[dict], plain: list[dict], floor: float, path: Path) -> Path:
    """The figure: each restart's MTTR as stacked phases, cold and warm (with the floor and the goals),
    and the wall time of each training in goodput categories."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from relaunch.components.core.tracking.goodput import BREAKDOWN

    # the restarts that started a new attempt (every kill under torchrun; in place, those of rank 0)
    bars = [(f"{how_of(run)}, restart {i + 1}", phases)
            for run in killed for i, phases in enumerate(run["phases"])]
    hows = {how_of(run) for run in killed}
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 1.6 + 0.32 * max(len(bars), 4)),
                                      gridspec_kw={"width_ratios": [1.3, 1]})
    colors = plt.get_cmap("tab10").colors
    for i, (_, phases) in enumerate(bars):
        x = 0.0
        for j, name in enumerate(PHASES):
            left.barh([i], [phases[name]], left=x, color=colors[j], label=name if i == 0 else None)
            x += phases[name]
    left.axvline(floor, color="black", linestyle=":", label=f"floor: import torch + torch.distributed ({floor:.2f} s)")
    if hows & {"cold", "warm"}:
        left.axvline(GOAL_COLD_OVER_FLOOR * floor, color="tab:red", linestyle="--",
                     label=f"goal, cold: {GOAL_COLD_OVER_FLOOR:g} x floor")
        left.axvline(GOAL_MTTR_WARM, color="tab:green", linestyle="--", label=f"goal, warm: {GOAL_MTTR_WARM:g} s")
    if hows & {"inplace", "inplace-warm"}:
        left.axvline(GOAL_INPLACE_COLD_OVER_FLOOR * floor, color="tab:red", linestyle="-.",
                     label=f"goal, in place cold: {GOAL_INPLACE_COLD_OVER_FLOOR:g} x floor")
        left.axvline(GOAL_MTTR_INPLACE_WARM, color="tab:green", linestyle="-.",
                     label=f"goal, in place warm: {GOAL_MTTR_INPLACE_WARM:g} s")
    left.set_yticks(range(len(bars)), [label for label, _ in bars])
    left.invert_yaxis()
    left.set_xlabel("seconds from SIGKILL to the first resumed step")
    left.set_title("MTTR by phase: fresh interpreters (cold, inplace) and zygote forks (warm, inplace-warm)")
    left.legend(loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=3, fontsize=7, frameon=False)
    runs = [(f"{'SIGKILLed' if run['name'].endswith('killed') else 'undisturbed'}, {how_of(run)}", run)
            for run in [*killed, *plain]]
    for i, (_, run) in enumerate(runs):
        x = 0.0
        for j, category in enumerate(BREAKDOWN):
            value = float(run["report"].get(category, 0.0))
            right.barh([i], [value], left=x, color=colors[j], label=category.replace("_", " ") if i == 0 else None)
            x += value
        right.text(x, i, f"  ETTR {run['report'].get('ettr', 0.0):.3f}", va="center", fontsize=8)
    right.set_yticks(range(len(runs)), [label for label, _ in runs])
    right.invert_yaxis()
    right.set_xlabel("wall seconds")
    right.set_title(f"ETTR in goodput categories ({killed[0]['kills'] if killed else 0} kills each)")
    right.legend(loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=3, fontsize=7, frameon=False)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90, bbox_inches="tight")
    plt.close(fig)
    return path


def lost_per_kill(killed: dict, plain: dict) -> float:
    """Wall seconds not productive per kill, beyond what the undisturbed training lost."""
    return ((killed["report"]["wall"] - killed["report"]["productive"])
            - (plain["report"]["wall"] - plain["report"]["productive"])) / max(1, killed["kills"])


def long_run_ettr(killed: dict, plain: dict) -> float:
    """ETTR of a training long enough that its first start and its final save are amortised, SIGKILLed
    every 60 s: the lost time per kill over 60 s, plus the undisturbed run's steady-state loss (what it
    lost between its first start and its final save, over that time)."""
    report = plain["report"]
    once = report.get("startup", 0.0) + plain.get("final_save", 0.0)
    steady = (report["wall"] - report["productive"] - once) / max(1e-9, report["wall"] - once)
    return max(0.0, 1 - lost_per_kill(killed, plain) / 60 - steady)


def final_save_seconds(attempt) -> float:
    """What the training's last save (``wait``: until committed) stalled it, from its attempt record:
    its stall and evaluation time past what they were when that save began."""
    began = attempt.commits.get(str(attempt.last_step))
    return max(0.0, attempt.stall_seconds + attempt.eval_seconds - began[1]) if began else 0.0


def restart_rows(run: dict, plain: dict, floor: float, kill_every: float) -> list[dict]:
    """The rows of one SIGKILLed training (cold or warm): ETTR, its projection to a kill every 60 s,
    MTTR p50/p95 against its goal, and each phase's p50/p95."""
    how = how_of(run)
    lost = lost_per_kill(run, plain)
    p95 = _percentile(run["mttr"], 0.95)
    goal, goal_text = {
        "warm": (GOAL_MTTR_WARM, f"<= {GOAL_MTTR_WARM:g}"),
        "inplace-warm": (GOAL_MTTR_INPLACE_WARM, f"<= {GOAL_MTTR_INPLACE_WARM:g}"),
        "inplace": (GOAL_INPLACE_COLD_OVER_FLOOR * floor,
                    f"<= {GOAL_INPLACE_COLD_OVER_FLOOR:g} x floor = {GOAL_INPLACE_COLD_OVER_FLOOR * floor:.2f}"),
    }.get(how, (GOAL_COLD_OVER_FLOOR * floor, f"<= {GOAL_COLD_OVER_FLOOR:g} x floor = {GOAL_COLD_OVER_FLOOR * floor:.2f}"))
    goal_ettr = GOAL_ETTR_INPLACE if how.startswith("inplace") else GOAL_ETTR
    at60 = "" if kill_every == 60 else " (at 60 s)"
    rows = [
        {"metric": f"ETTR, {how}, SIGKILL every {kill_every:.0f}s ({run['kills']} kills)", "value": run["report"]["ettr"],
         "goal": f">= {goal_ettr}{at60}", "detail": _categories(run["report"])},
        {"metric": f"ETTR, {how}, projected to a SIGKILL every 60 s", "value": plain["report"]["ettr"] * max(0.0, 1 - lost / 60),
         "goal": f">= {goal_ettr}", "detail": f"undisturbed ETTR x (1 - {lost:.2f} s lost per kill / 60 s); the "
                                          f"undisturbed run's first start ({plain['report'].get('startup', 0.0):.1f} s) "
                                          f"in a {plain['report']['wall']:.0f} s training"},
        {"metric": f"ETTR, {how}, a long training with a SIGKILL every 60 s", "value": long_run_ettr(run, plain),
         "goal": f">= {goal_ettr}", "detail": f"1 - {lost:.2f} s lost per kill / 60 s - the undisturbed run's steady "
                                          f"loss (checkpoint stalls, evaluation; its first start and its final save, "
                                          f"{plain.get('final_save', 0.0):.2f} s, amortised); "
                                          + (f"checkpoints every {CHECKPOINT_EVERY_INPLACE:g} s, a snapshot in "
                                             f"memory every {SNAPSHOT_EVERY} steps" if how.startswith("inplace")
                                             else f"checkpoints every {CHECKPOINT_EVERY:g} s")},
        {"metric": f"MTTR p50, {how} (kill -> first step after resume, s)", "value": _percentile(run["mttr"], 0.5),
         "goal": "-", "detail": json.dumps([round(m, 2) for m in run["mttr"]])},
        {"metric": f"MTTR p95, {how} (s)", "value": p95, "goal": goal_text,
         "detail": f"{p95 / floor:.2f} x floor; {'met' if p95 <= goal else 'missed'}; torchrun --monitor-interval="
                   f"{monitor_interval():g}, rdzv {RDZV_CONF}" + (f"; {run['cold_starts']} workers started cold" if how == "warm" else "")},
    ]
    for name in PHASES if run["phases"] else ():  # torchrun's restarts; a recovery in place has no new attempt
        values = [b[name] for b in run["phases"]]
        rows.append({"metric": f"MTTR phase, {how}: {name}, p50 (s)", "value": _percentile(values, 0.5), "goal": "-",
                     "detail": f"p95 {_percentile(values, 0.95):.3f} s; each: {json.dumps([round(v, 3) for v in values])}"})
    return rows


def _categories(report: dict) -> str:
    wall = report.get("wall") or 1.0
    return json.dumps({k: f"{report.get(k, 0.0):.1f} s ({100 * report.get(k, 0.0) / wall:.1f}%)"
                       for k in ("wall", "productive", "startup", "checkpoint_stall", "evaluation",
                                 "recomputed", "restart_gaps")})


def training_config(store: Path, tracking_uri: str, name: str, steps: int, step_sleep: float) -> dict:
    """The benches' training: ``steps`` steps of ``step_sleep`` s, async checkpoints every CHECKPOINT_EVERY s."""
    return {"store": {"uri": str(store)},
            "tracking": {"uri": tracking_uri, "experiment": f"bench-{name}"},
            "train": {"max_steps": steps, "step_sleep_seconds": step_sleep, "checkpoint_every_steps": None,
                      "checkpoint_every_seconds": CHECKPOINT_EVERY, "checkpoint_at_epoch_end": False,
                      "log_every_steps": 1}}


@dataclass
class KilledTrainings:
    """Where a bench of trainings SIGKILLed every ``kill_every`` s runs: its folder, its MLflow server, and
    ``config(name)``, a training of ``steps`` steps long enough for ``kills`` kills and a clean stretch."""
    workdir: Path
    tracking_uri: str
    kill_every: float
    kills: int
    steps: int
    step_sleep: float = 0.02

    def config(self, name: str) -> dict:
        return training_config(self.workdir / name, self.tracking_uri, name, self.steps, self.step_sleep)


@contextlib.contextmanager
def killed_trainings(prefix: str, kill_every: float, kills: int) -> Iterator[KilledTrainings]:
    """A fresh folder and an MLflow server (sqlite) for the block; ``BENCH_KILL_EVERY`` and ``BENCH_KILLS``
    override the cadence."""
    from tests.services import MlflowServer

    kill_every = float(os.environ.get("BENCH_KILL_EVERY", kill_every))
    kills = int(os.environ.get("BENCH_KILLS", kills))
    workdir = Path(tempfile.mkdtemp(prefix=prefix))
    server = MlflowServer(backend_uri=f"sqlite:///{workdir / 'mlflow.db'}", artifacts_dir=workdir / "artifacts").start()
    try:
        step_sleep = KilledTrainings.step_sleep
        yield KilledTrainings(workdir, server.uri, kill_every, kills, int((kills + 1) * kill_every / (step_sleep + 0.004)))
    finally:
        server.stop()


def run(quick: bool) -> list[dict]:
    with killed_trainings("bench-training-", *((8.0, 5) if quick else (60.0, 5))) as bench:
        workdir, config, kill_every, kills, steps = bench.workdir, bench.config, bench.kill_every, bench.kills, bench.steps
        floors: list[float] = []
        plain, killed = {}, []
        for how in HOWS:  # the floor before each training: a busy machine's load drifts
            floors += import_floor(1)
            plain[how] = _training(config(f"{how}-plain"), workdir, kill_every=None, kills=0, how=how)
            floors += import_floor(2)
            killed.append(_training(config(f"{how}-killed"), workdir, kill_every=kill_every, kills=kills, how=how))
        floors += import_floor(1)
        logging = _logging_overhead(bench.tracking_uri, 300 if quick else 2000)
    floor = statistics.median(floors)
    figure = plot_breakdown(killed, list(plain.values()), floor, FIGURE)
    tracking = plain[HOWS[0]]["tracking"]
    wall_overhead = (logging["logged_step_seconds"] - logging["step_seconds"]) / logging["step_seconds"]
    cpu_overhead = (logging["main_thread_seconds_per_call"] + logging["sender_cpu_seconds_per_step"]) \
        / logging["step_seconds"]
    rows = [
        {"metric": "floor: fresh interpreter importing torch + torch.distributed (s)", "value": floor, "goal": "-",
         "detail": json.dumps([round(f, 2) for f in floors])},
    ]
    for run_ in killed:
        how = how_of(run_)
        rows.append({"metric": f"ETTR, {how}, undisturbed", "value": plain[how]["report"]["ettr"], "goal": "-",
                     "detail": _categories(plain[how]["report"])})
        rows += restart_rows(run_, plain[how], floor, kill_every)
        rows.append({"metric": f"wall ratio undisturbed / SIGKILLed, {how} (same work)",
                     "value": plain[how]["wall"] / run_["wall"], "goal": "-",
                     "detail": f"{plain[how]['wall']:.1f}s vs {run_['wall']:.1f}s, {steps} steps"})
    rows += [
        {"metric": "MLflow logging / step time, in the 2-process training (rank 0)",
         "value": tracking.get("ratio", float("nan")), "goal": f"<= {GOAL_LOGGING}",
         "detail": "caller {:.1f} us + sender CPU {:.1f} us per step; step {:.2f} ms without the demo sleep".format(
             tracking.get("main_thread_seconds_per_step", 0) * 1e6,
             tracking.get("sender_cpu_seconds_per_step", 0) * 1e6,
             tracking.get("step_seconds", 0) * 1e3)},
        {"metric": "MLflow logging CPU per step / step CPU, bare digits step in-process", "value": cpu_overhead,
         "goal": f"<= {GOAL_LOGGING}",
         "detail": f"main thread {logging['main_thread_seconds_per_call'] * 1e6:.1f} us/call + sender thread "
                   f"{logging['sender_cpu_seconds_per_step'] * 1e6:.1f} us/step, step "
                   f"{logging['step_seconds'] * 1e3:.3f} ms; {logging['points_sent']} points sent"},
        {"metric": "step CPU logged / plain - 1 (A/B, same process)", "value": wall_overhead,
         "goal": "-", "detail": f"{logging['logged_step_seconds'] * 1e3:.3f} ms vs {logging['step_seconds'] * 1e3:.3f} ms"},
        {"metric": "figure", "value": float(sum(len(r["phases"]) for r in killed)), "goal": "-", "detail": str(figure)},
    ]
    return rows


if __name__ == "__main__":
    for row in run(quick="--quick" in sys.argv):
        print(row)
