"""The run ledger: each attempt's record, how the latest one ended, and the training's summary, kept in
the store's ``runs/`` records and read by the launchers, the steps and ``relaunch run``.

Rank 0 of every attempt keeps ``runs/attempts/attempt-<nnnn>.json`` in the store up to date
(:class:`AttemptLog`: start, training-loop start, first step, last step seen, committed steps, checkpoint
stall, evaluation time, end, exit code). An attempt killed with SIGKILL simply stops updating its record;
its last update stands for its end. :func:`claim_attempt` numbers attempts by a conditional create, so
two racing writers cannot share one.

:func:`record_ending` writes ``runs/exit.json`` (how the latest attempt ended, under our control) and
``runs/summary.json`` (the training summary, :class:`TrainSummary`); :func:`refuse_permanent_restart`
reads the first back so that torchrun does not restart a permanent failure; :func:`reached_its_end` and
:func:`completed` read the second. Every ``runs/`` key and its JSON helpers live in
:mod:`relaunch.components.core.store.records`; the goodput report over the attempts is
:mod:`relaunch.components.core.tracking.goodput`'s.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from ..contract.errors import error_for
from ..contract.exitcodes import ExitCode, PERMANENT, unrecorded_end
from . import records


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
    records.write_exit_record(store, summary.attempt, summary.exit_code, summary.reason, elastic_run_id)
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
