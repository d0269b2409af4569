"""Goodput bookkeeping across attempts, the ETTR report, and the end-of-attempt records the
launchers read.

Rank 0 of every attempt keeps ``runs/attempts/attempt-<nnnn>.json`` in the store up to date (start,
training-loop start, first step, last step seen, committed steps, checkpoint stall, evaluation time,
end, exit code). An attempt killed with SIGKILL simply stops updating its record; its last update
stands for its end. From all records :func:`goodput_report` derives the effective training time
ratio (ETTR = productive time / wall time from the first start to the last end) and its breakdown:

    wall = productive + start-up + checkpoint stall + evaluation + recomputed steps + restart gaps

``recomputed`` is work done after the checkpoint the next attempt resumed from (lost, done again);
``restart gaps`` is the time between an attempt's end and the next one's start, and, for a worker
recovered in place (``train.memory_tier``: the attempt goes on), the time from its loss to the resume.

:func:`record_ending` writes ``runs/exit.json`` (how the latest attempt ended, under our control)
and ``runs/summary.json`` (the training summary, :class:`TrainSummary`). Every ``runs/`` key and its
JSON helpers live in :mod:`relaunch.components.core.store.records`.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from relaunch.components.core.contract.errors import error_for
from relaunch.components.core.contract.exitcodes import ExitCode, PERMANENT, unrecorded_end
from relaunch.components.core.store import records
from relaunch.components.core.store.records import write_exit_record  # train.py writes it through goodput too

@dataclass
class Attempt:
    """One start of the worker group, as rank 0 saw it (wall-clock seconds, ``time.time()``)."""

    attempt: int
    start: float
    world_size: int = 1
    resumed_from_step: int = -1
    resumed_from_time: float | None = None  # when the step it resumed from was done (a memory snapshot's time)
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
    created: float | None = None  # when the worker process was created (``start`` is its first line's time)
    in_place: list[dict[str, Any]] = field(default_factory=list)  # recoveries of a lost worker inside this attempt

    @property
    def ended(self) -> float:
        return self.end if self.end is not None else max(self.last_seen, self.loop_start or 0.0, self.start)

    @property
    def outcome(self) -> int:
        """Its exit code; an attempt that never wrote one died without control (SIGKILL, OOM): 137."""
        return unrecorded_end(self.exit_code)


@dataclass
class TrainSummary:
    """What an attempt reports (``runs/summary.json``, the ``summary`` event, the step's outputs)."""

    exit_code: int
    reason: str
    run_id: str | None
    attempt: int
    attempts: int = 0
    resumed_from_steps: list[int] = field(default_factory=list)
    last_step: int = -1
    last_committed_step: int = -1
    last_checkpoint_uri: str | None = None
    total_steps: int = 0
    train_seconds: float = 0.0
    ettr: float | None = None
    goodput: dict = field(default_factory=dict)
    final_metrics: dict = field(default_factory=dict)

    @property
    def reached_the_end(self) -> bool:
        return self.exit_code == ExitCode.OK and self.total_steps > 0 and self.last_step >= self.total_steps


def load_attempts(store) -> list[Attempt]:
    """Every attempt record of this store, in order."""
    out = []
    for key in records.attempt_keys(store):
        data = records.read_json(store, key)
        if data is not None:
            out.append(Attempt(**{k: v for k, v in data.items() if k in Attempt.__dataclass_fields__}))
    return sorted(out, key=lambda a: a.attempt)


def claim_attempt(store, start: float, world_size: int, *, created: float | None = None) -> Attempt:
    """Create the next attempt's record (conditional create, so two racing writers cannot share a number)."""
    n = len(records.attempt_keys(store)) + 1
    while True:
        record = Attempt(attempt=n, start=start, world_size=world_size, last_seen=time.time(), created=created)
        if records.write_json_if_absent(store, records.attempt_key(n), asdict(record)):
            return record
        n += 1


class AttemptLog:
    """Rank 0's writer of its attempt record: cheap, throttled heartbeats plus forced writes at events."""

    def __init__(self, store, record: Attempt, *, heartbeat_seconds: float = 2.0):
        self.store, self.record, self.heartbeat_seconds = store, record, heartbeat_seconds
        self._written = 0.0

    def write(self) -> None:
        self.record.last_seen = time.time()
        records.write_json(self.store, records.attempt_key(self.record.attempt), asdict(self.record))
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
        elif r.in_place and "first_step_time" not in r.in_place[-1]:  # the first step after a recovery in place
            r.in_place[-1]["first_step_time"] = now
            self.write()
        elif time.monotonic() - self._written >= self.heartbeat_seconds:
            self.write()

    def committed(self, step: int, step_time: float, overhead: float) -> None:
        r = self.record
        r.last_committed_step = max(r.last_committed_step, step)
        r.commits[str(step)] = [step_time, overhead]
        self.write()

    def recovered_in_place(self, *, lost_at_step: int, resumed_step: int, lost_at: float, seconds: float,
                           source: str, resumed_at: float | None = None) -> None:
        """A worker was lost at ``lost_at`` (time) after step ``lost_at_step``; the survivors and its
        replacement went on from ``resumed_step`` (from ``source``: memory or the store) ``seconds`` later,
        inside this attempt (``train.memory_tier``). ``resumed_at``: when ``resumed_step`` was done, for
        a step no commit recorded (a memory snapshot's)."""
        entry = {"lost_at_step": int(lost_at_step), "resumed_step": int(resumed_step), "lost_at": float(lost_at),
                 "seconds": float(seconds), "source": source}
        if resumed_at is not None:
            entry["resumed_at"] = float(resumed_at)
        self.record.in_place.append(entry)
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
        for r in a.in_place:
            gaps += r["seconds"]
            resumed_at = r.get("resumed_at", a.commits.get(str(r["resumed_step"]), [None])[0])
            if resumed_at is not None:
                recomputed += max(0.0, r["lost_at"] - resumed_at)
        if i + 1 < len(attempts):
            nxt = attempts[i + 1]
            if a.loop_start is None:
                gaps += max(0.0, nxt.start - a.ended)
                continue
            resumed = nxt.resumed_from_step
            if resumed <= a.resumed_from_step:
                t_resume = a.loop_start
            elif nxt.resumed_from_time is not None:  # a step of ``a`` kept in memory: its time is known
                t_resume = min(nxt.resumed_from_time, nxt.start)
            else:
                t_resume = _step_time(a, resumed)
            # a record killed with its attempt is up to a heartbeat old: the steps up to the resumed one
            # were done (and kept) after it, so the gap starts at the later of the two
            gaps += max(0.0, nxt.start - max(a.ended, t_resume))
            overhead_then = a.commits.get(str(resumed), [0.0, None])[1]
            lost_overhead = (a.stall_seconds + a.eval_seconds - overhead_then) if overhead_then is not None else 0.0
            recomputed += max(0.0, a.ended - t_resume - max(0.0, lost_overhead))
    productive = max(0.0, wall - startup - stall - evaluation - recomputed - gaps)
    return {
        "ettr": productive / wall if wall > 0 else 0.0,
        "wall": wall, "productive": productive, "startup": startup, "checkpoint_stall": stall,
        "evaluation": evaluation, "recomputed": recomputed, "restart_gaps": gaps,
        "attempts": len(attempts), "resumed_from_steps": [a.resumed_from_step for a in attempts],
        "last_steps": [a.last_step for a in attempts], "exit_codes": [a.outcome for a in attempts],
        "in_place": [r for a in attempts for r in a.in_place],
    }


ENDINGS = {ExitCode.KILLED: "killed (SIGKILL, OOM)", ExitCode.PREEMPTED: "preempted (SIGTERM)",
           ExitCode.RETRY_ME: "transient failure", ExitCode.INTERRUPTED: "interrupted (SIGINT)"}
"""How an attempt's end reads in the goodput legend: the exit code's meaning in a few words."""


def _ending(code: int | None) -> str:
    """``exit 137, killed (SIGKILL, OOM)``: the legend's words for an attempt's exit code."""
    return f"exit {code}, {ENDINGS[code]}" if code in ENDINGS else f"exit {code}"


BREAKDOWN = ("productive", "startup", "checkpoint_stall", "evaluation", "recomputed", "restart_gaps")


def plot_goodput(report: dict[str, Any], loss_curve: list[tuple[int, float]], path: str) -> str:
    """One PNG: the wall-time breakdown as one stacked bar (legend below it, never over it), and the
    loss curve with every attempt's end marked and the steps done twice shaded. Returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (bar, loss) = plt.subplots(1, 2, figsize=(12, 4.8), gridspec_kw={"width_ratios": [1, 1.6]})
    wall = float(report.get("wall", 0.0)) or 1.0
    left = 0.0
    for name in BREAKDOWN:
        value = float(report.get(name, 0.0))
        bar.barh([0], [value], left=left, height=0.5,
                 label=f"{name.replace('_', ' ')}: {value:.1f} s ({100 * value / wall:.0f}%)")
        left += value
    bar.set_yticks([])
    bar.set_xlabel("wall time, seconds")
    bar.set_ylim(-0.5, 0.5)
    bar.set_title(f"ETTR {report.get('ettr', 0.0):.3f} over {report.get('attempts', 0)} attempt(s)")
    bar.legend(loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=2, fontsize=8, frameon=False)
    if loss_curve:
        steps, losses = zip(*sorted(loss_curve))
        loss.plot(steps, losses, color="tab:blue", label="train loss")
    resumed = list(report.get("resumed_from_steps", []))
    ends = list(report.get("last_steps", []))
    codes = list(report.get("exit_codes", []))
    for i in range(len(resumed) - 1):
        end, code, again = (ends[i] if i < len(ends) else -1), (codes[i] if i < len(codes) else None), resumed[i + 1]
        if end >= 0:
            loss.axvline(end, color="tab:red", linewidth=1.5,
                         label=f"attempt {i + 1} ended at step {end}: {_ending(code)}")
        if 0 <= again < end:
            loss.axvspan(again, end, color="tab:orange", alpha=0.25,
                         label=f"recomputed: steps {again + 1}-{end}")
        if again >= 0:
            loss.axvline(again, color="tab:green", linestyle="--", linewidth=1,
                         label=f"attempt {i + 2} resumed from step {again}")
    for r in report.get("in_place", []):
        lost, again = int(r["lost_at_step"]), int(r["resumed_step"])
        loss.axvline(lost, color="tab:purple", linewidth=1.5,
                     label=f"worker lost at step {lost}: recovered in place from {r['source']} "
                           f"in {float(r['seconds']):.2f} s")
        if 0 <= again < lost:
            loss.axvspan(again, lost, color="tab:purple", alpha=0.15, label=f"recomputed: steps {again + 1}-{lost}")
    loss.set_xlabel("step")
    loss.set_ylabel("train loss")
    loss.set_title("loss, restarts and recomputed steps")
    loss.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90, bbox_inches="tight")
    plt.close(fig)
    return path


def summarize(store, code: int, reason: str, *, run_id: str | None, attempt: int, last_step: int, last_committed: Any,
              total_steps: int, train_seconds: float, report: dict[str, Any] | None,
              final_metrics: dict[str, float]) -> TrainSummary:
    """The summary of an attempt that ends with ``code``; with ``store`` (rank 0) every attempt's start
    step too. ``last_committed``: the CheckpointInfo of the newest committed checkpoint, or None."""
    attempts = load_attempts(store) if store is not None else []
    return TrainSummary(
        exit_code=int(code), reason=reason, run_id=run_id, attempt=attempt, attempts=len(attempts),
        resumed_from_steps=[a.resumed_from_step for a in attempts], last_step=last_step,
        last_committed_step=last_committed.step if last_committed is not None else -1,
        last_checkpoint_uri=last_committed.uri if last_committed is not None else None, total_steps=total_steps,
        train_seconds=round(train_seconds, 3), ettr=report.get("ettr") if report else None,
        goodput=report or {}, final_metrics=final_metrics)


def record_ending(store, summary: TrainSummary, elastic_run_id: str = "") -> None:
    """Rank 0, at every ending under our control: ``runs/exit.json`` and ``runs/summary.json``."""
    write_exit_record(store, summary.attempt, summary.exit_code, summary.reason, elastic_run_id)
    records.write_summary(store, asdict(summary))


def refuse_permanent_restart(store, restart_count: int, elastic_run_id: str) -> None:
    """torchrun restarts a worker group whatever its exit code; a permanent failure (bad input, a
    divergence, a bug) of this same torchrun run ends the restart at once with the same code."""
    if restart_count == 0 or not elastic_run_id:
        return
    record = records.read_exit_record(store)
    if record and record.get("elastic_run_id") == elastic_run_id and record.get("exit_code") in PERMANENT:
        raise error_for(record["exit_code"], f"not restarting after a permanent failure: {record.get('reason', '')}")


def reached_its_end(summary: dict | None) -> bool:
    """Whether the trainer's summary says the training trained its last step and ended well."""
    if not summary:
        return False
    return TrainSummary(**{k: v for k, v in summary.items() if k in TrainSummary.__dataclass_fields__}).reached_the_end


def completed(summary: dict | None) -> bool:
    """Whether the summary's training reached its end at exactly its last step: a checkpoint past
    the total ("step 83 of 76") is another training's, never one to evaluate or register."""
    return reached_its_end(summary) and int(summary["last_step"]) == int(summary["total_steps"])
