"""Goodput bookkeeping across attempts, the ETTR report, and the end-of-attempt records the
launchers read.

Rank 0 of every attempt keeps ``runs/attempts/attempt-<nnnn>.json`` in the store up to date (start,
training-loop start, first step, last step seen, committed steps, checkpoint stall, evaluation time,
end, exit code). An attempt killed with SIGKILL simply stops updating its record; its last update
stands for its end. From all records :func:`goodput_report` derives the effective training time
ratio (ETTR = productive time / wall time from the first start to the last end) and its breakdown:

    wall = productive + start-up + checkpoint stall + evaluation + recomputed steps + restart gaps

``recomputed`` is work done after the checkpoint the next attempt resumed from (lost, done again);
``restart gaps`` is the time between an attempt's end and the next one's start.

Other keys of this module, all relative to the store root: ``runs/exit.json`` (how the latest
attempt ended, under our control) and ``runs/summary.json`` (the training summary).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from components.core.exitcodes import ExitCode, normalize

ATTEMPTS_PREFIX = "runs/attempts/"
EXIT_KEY = "runs/exit.json"
SUMMARY_KEY = "runs/summary.json"
RUN_KEY = "runs/mlflow-run.json"


@dataclass
class Attempt:
    """One start of the worker group, as rank 0 saw it (wall-clock seconds, ``time.time()``)."""

    attempt: int
    start: float
    world_size: int = 1
    resumed_from_step: int = -1
    loop_start: float | None = None
    first_step_time: float | None = None
    last_step: int = -1
    last_seen: float = 0.0
    last_committed_step: int = -1
    commits: dict[str, list[float]] = field(default_factory=dict)  # step -> [step done at, overhead so far]
    stall_seconds: float = 0.0
    eval_seconds: float = 0.0
    end: float | None = None
    exit_code: int | None = None
    phases: dict[str, float] = field(default_factory=dict)  # start-up phase -> seconds after start

    @property
    def ended(self) -> float:
        return self.end if self.end is not None else max(self.last_seen, self.loop_start or 0.0, self.start)


def attempt_key(n: int) -> str:
    return f"{ATTEMPTS_PREFIX}attempt-{n:04d}.json"


def load_attempts(store) -> list[Attempt]:
    """Every attempt record of this store, in order."""
    out = []
    for key in store.list(ATTEMPTS_PREFIX):
        if key.endswith(".json"):
            data = json.loads(store.read_bytes(key))
            out.append(Attempt(**{k: v for k, v in data.items() if k in Attempt.__dataclass_fields__}))
    return sorted(out, key=lambda a: a.attempt)


def claim_attempt(store, start: float, world_size: int) -> Attempt:
    """Create the next attempt's record (conditional create, so two racing writers cannot share a number)."""
    n = len([k for k in store.list(ATTEMPTS_PREFIX) if k.endswith(".json")]) + 1
    while True:
        record = Attempt(attempt=n, start=start, world_size=world_size, last_seen=time.time())
        if store.write_if_absent(attempt_key(n), json.dumps(asdict(record)).encode()):
            return record
        n += 1


class AttemptLog:
    """Rank 0's writer of its attempt record: cheap, throttled heartbeats plus forced writes at events."""

    def __init__(self, store, record: Attempt, *, heartbeat_seconds: float = 2.0):
        self.store, self.record, self.heartbeat_seconds = store, record, heartbeat_seconds
        self._written = 0.0

    def write(self) -> None:
        self.record.last_seen = time.time()
        self.store.write_bytes(attempt_key(self.record.attempt), json.dumps(asdict(self.record)).encode())
        self._written = time.monotonic()

    def step_done(self, step: int) -> None:
        """A step finished (``step`` = the number of steps done so far)."""
        r = self.record
        r.last_step = step
        now = time.time()
        r.last_seen = now
        if r.first_step_time is None:
            r.first_step_time = now
            self.write()
        elif time.monotonic() - self._written >= self.heartbeat_seconds:
            self.write()

    def committed(self, step: int, step_time: float, overhead: float) -> None:
        r = self.record
        r.last_committed_step = max(r.last_committed_step, step)
        r.commits[str(step)] = [step_time, overhead]
        self.write()

    def finish(self, exit_code: int) -> None:
        self.record.end = time.time()
        self.record.exit_code = int(exit_code)
        self.write()


def _step_time(a: Attempt, step: int) -> float:
    """When ``a`` finished ``step`` (recorded at a commit, else interpolated from its step rate)."""
    if str(step) in a.commits:
        return a.commits[str(step)][0]
    if a.loop_start is None or step <= a.resumed_from_step:
        return a.loop_start or a.start
    done = max(1, a.last_step - max(a.resumed_from_step, 0))
    rate = (a.ended - a.loop_start) / done
    return a.ended - max(0, a.last_step - step) * rate


def goodput_report(attempts: list[Attempt]) -> dict[str, Any]:
    """ETTR and its breakdown in seconds (keys: wall, productive, startup, checkpoint_stall,
    evaluation, recomputed, restart_gaps, ettr, attempts, resumed_from_steps)."""
    if not attempts:
        return {"ettr": 0.0, "wall": 0.0, "attempts": 0}
    wall = attempts[-1].ended - attempts[0].start
    startup = stall = evaluation = recomputed = gaps = 0.0
    for i, a in enumerate(attempts):
        loop_start = a.loop_start if a.loop_start is not None else a.ended
        startup += max(0.0, loop_start - a.start)
        stall += a.stall_seconds
        evaluation += a.eval_seconds
        if i + 1 < len(attempts):
            nxt = attempts[i + 1]
            gaps += max(0.0, nxt.start - a.ended)
            if a.loop_start is not None:
                resumed = nxt.resumed_from_step
                t_resume = _step_time(a, resumed) if resumed > a.resumed_from_step else a.loop_start
                overhead_then = a.commits.get(str(resumed), [0.0, None])[1]
                lost_overhead = (a.stall_seconds + a.eval_seconds - overhead_then) if overhead_then is not None else 0.0
                recomputed += max(0.0, a.ended - t_resume - max(0.0, lost_overhead))
    productive = max(0.0, wall - startup - stall - evaluation - recomputed - gaps)
    return {
        "ettr": productive / wall if wall > 0 else 0.0,
        "wall": wall, "productive": productive, "startup": startup, "checkpoint_stall": stall,
        "evaluation": evaluation, "recomputed": recomputed, "restart_gaps": gaps,
        "attempts": len(attempts), "resumed_from_steps": [a.resumed_from_step for a in attempts],
    }


def plot_goodput(report: dict[str, Any], loss_curve: list[tuple[int, float]], path: str) -> str:
    """A PNG: the wall-time breakdown as one stacked bar, and the loss curve. Returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [1, 2]})
    parts = ["productive", "startup", "checkpoint_stall", "evaluation", "recomputed", "restart_gaps"]
    bottom = 0.0
    for name in parts:
        value = float(report.get(name, 0.0))
        ax1.bar(["wall time"], [value], bottom=bottom, label=f"{name} {value:.1f}s")
        bottom += value
    ax1.set_ylabel("seconds")
    ax1.set_title(f"ETTR {report.get('ettr', 0.0):.3f} over {report.get('attempts', 0)} attempt(s)")
    ax1.legend(fontsize=7, loc="upper right")
    if loss_curve:
        steps, losses = zip(*sorted(loss_curve))
        ax2.plot(steps, losses)
    for step in report.get("resumed_from_steps", [])[1:]:
        ax2.axvline(step, color="red", alpha=0.4, linestyle="--")
    ax2.set_xlabel("step")
    ax2.set_ylabel("train loss")
    ax2.set_title("loss (dashed: resumed from)")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def write_exit_record(store, attempt: int, exit_code: int, reason: str, elastic_run_id: str = "") -> None:
    """How this attempt ended (rank 0, every ending under our control)."""
    store.write_bytes(EXIT_KEY, json.dumps({"attempt": attempt, "exit_code": int(exit_code), "reason": reason,
                                            "time": time.time(), "elastic_run_id": elastic_run_id}).encode())


def read_exit_record(store) -> dict[str, Any] | None:
    try:
        return json.loads(store.read_bytes(EXIT_KEY))
    except FileNotFoundError:
        return None


def mapped_exit_code(store, torchrun_returncode: int, started_at: float) -> int:
    """The contract's exit code of a torchrun that ended with ``torchrun_returncode``.

    torchrun exits 1 whenever a worker failed, whatever the worker's code. The latest attempt's
    ``runs/exit.json``, when written after ``started_at`` (``time.time()`` when torchrun was
    started), says what really happened; a failure without such a record is a worker that died
    without control (SIGKILL, OOM), hence 137. A torchrun killed by a signal maps to 128 + signal.
    """
    code = normalize(torchrun_returncode)
    if code == ExitCode.OK or code != ExitCode.BUG:
        return code
    record = read_exit_record(store)
    if record is not None and record.get("time", 0) >= started_at and record.get("exit_code"):
        return int(record["exit_code"])
    return int(ExitCode.KILLED)


def read_summary(store) -> dict[str, Any] | None:
    """The last training summary written to ``runs/summary.json``, or None."""
    try:
        return json.loads(store.read_bytes(SUMMARY_KEY))
    except FileNotFoundError:
        return None
