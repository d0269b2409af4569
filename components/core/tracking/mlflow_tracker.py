"""The MLflow tracker (:class:`~relaunch.components.core.tracking.trackers.Tracker`): the training's MLflow run,
fed through the asynchronous :class:`~relaunch.components.core.tracking.runlogger.RunLogger`, and the
pending-metrics record that carries unsent metric points across a crash.

What the run holds, kept true across restarts, in a form a person reads on the run page:

- ``checkpoint.latest`` and ``checkpoint.latest_step`` as tags (at each commit), and the whole
  checkpoint history in ONE artifact, ``relaunch/checkpoints.json`` (step, URI, the attempt that
  committed it, when, and whether it is still there or retention deleted it), rewritten at the first
  commit, then at most once per :data:`CHECKPOINT_HISTORY_SECONDS` and when the attempt closes (an
  upload through MLflow's client costs several requests of CPU on the thread that shares the GIL
  with the training; a killed attempt's last commits are written by the next attempt);
- the attempts summarised in tags (``relaunch.attempts``, ``relaunch.restarts``,
  ``relaunch.last_exit_code``) and told in full in ``relaunch/attempts.json`` (start, end, exit code
  and its meaning, last step, resumed-from step), the killed ones included;
- the goodput report as ``goodput.*`` tags (single numbers, not one-point metric series) plus the
  ``goodput/goodput.png`` figure and ``goodput/goodput.json``;
- the metrics, health counters (``health/*``) only once one is not zero: a chart of zeros says nothing
  and would sort before the loss.

An unreachable server never stops the training: the logger buffers and retries on its own thread,
with one line on the console (a ``tracking`` event) when contact is lost and one when it is back;
only what retrying cannot help (refused credentials, :attr:`RunLogger.fatal`) is raised, as bad input.
What the server has not confirmed when the attempt ends (it waits for a lost server only
:data:`~relaunch.components.core.tracking.runlogger.WAIT_WHILE_LOST_SECONDS`) stays in the pending-metrics
record, with the outage's ``relaunch.tracking.*`` tags; :func:`deliver_pending_metrics` sends it
(finalize, and prepare of the next ``--resume``), as does the next attempt.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from typing import Any

from ..checkpoint import checkpoint_steps, step_key
from ..contract.errors import BadInput
from ..contract.events import Kind, emit
from ..contract.exitcodes import MEANING
from ..store import ledger, records
from . import goodput
from .tracker_protocol import AttemptEnd, AttemptStart, TrackerBase

DELETED_BY_RETENTION = "deleted by retention"
FLUSH_SECONDS_BEFORE_PLOT = 30.0
CHECKPOINT_HISTORY_SECONDS = 60.0  # relaunch/checkpoints.json is rewritten at most this often while training
ARTIFACT_DIR = "relaunch"
CHECKPOINTS_ARTIFACT = f"{ARTIFACT_DIR}/checkpoints.json"
ATTEMPTS_ARTIFACT = f"{ARTIFACT_DIR}/attempts.json"
HEALTH_PREFIX = "health/"
DELIVERY_SECONDS = 30.0  # how long prepare or finalize gives pending points to reach the server


def _iso(seconds: float | None) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds)) if seconds else ""


def attempt_summary_tags(attempts: list[ledger.Attempt], *, current: int | None = None) -> dict[str, str]:
    """The attempts in three tags: ``relaunch.attempts``, ``relaunch.restarts`` and
    ``relaunch.last_exit_code`` (of the newest attempt that ended; absent while none has)."""
    tags = {"relaunch.attempts": str(len(attempts)), "relaunch.restarts": str(max(0, len(attempts) - 1))}
    ended = [a for a in attempts if a.attempt != current]
    if ended:
        tags["relaunch.last_exit_code"] = str(ended[-1].outcome)
    return tags


def attempts_table(attempts: list[ledger.Attempt], *, current: int | None = None) -> list[dict[str, Any]]:
    """Every attempt as a row of ``relaunch/attempts.json``; ``current`` (still running) without an end.
    An attempt killed without a word ends at its last heartbeat with exit 137 and ``end_recorded`` false."""
    rows = []
    for a in attempts:
        row: dict[str, Any] = {"attempt": a.attempt, "start": _iso(a.start), "world_size": a.world_size,
                               "resumed_from_step": a.resumed_from_step, "last_step": a.last_step,
                               "last_committed_step": a.last_committed_step}
        if a.attempt != current:
            row.update(end=_iso(a.ended), exit_code=a.outcome, ending=MEANING.get(a.outcome, "unknown code"),
                       end_recorded=a.end is not None)
        rows.append(row)
    return rows


def checkpoint_history(store, attempts: list[ledger.Attempt], extra: dict[int, int] | None = None) -> list[dict[str, Any]]:
    """Every checkpoint this training committed, oldest first, as rows of ``relaunch/checkpoints.json``:
    step, URI, the attempt that committed it, when, and its state ("kept", or "deleted by retention"
    when its folder is gone). ``extra``: step -> attempt of commits not yet in the attempt records."""
    existing = set(checkpoint_steps(store))
    committed: dict[int, tuple[int, float | None]] = {}
    for a in attempts:
        for step, (done_at, _overhead) in a.commits.items():
            committed[int(step)] = (a.attempt, done_at)
    for step, attempt in (extra or {}).items():
        committed.setdefault(step, (attempt, time.time()))
    return [{"step": step, "uri": store.uri_for(step_key(step)), "attempt": attempt, "committed_at": _iso(done_at),
             "state": "kept" if step in existing else DELETED_BY_RETENTION}
            for step, (attempt, done_at) in sorted(committed.items())]


def open_tracker(config, store, *, run_id: str | None, attempt: int) -> "MlflowTracker":
    """The MLflow tracker of this attempt (every training has its MLflow run)."""
    return MlflowTracker(config, store, run_id=run_id, attempt=attempt)


class MlflowTracker(TrackerBase):
    """Rank 0's MLflow run and pending-metrics record for one attempt."""

    def __init__(self, config, store, *, run_id: str | None, attempt: int):
        self.config, self.store, self.run_id, self.attempt = config, store, run_id, attempt
        self.logger = None  # RunLogger, from start()
        self.recent: list[list] = []  # [step, metrics] not yet confirmed by the tracking server
        self._resumed_from = -1
        self._committed: dict[int, int] = {}  # step -> attempt: this attempt's commits
        self._health_shown = False  # health/* counters are logged once one is not zero
        self._artifacts: tempfile.TemporaryDirectory | None = None  # files the logger uploads; removed at close
        self._history_written: float | None = None  # time.monotonic() of the last checkpoint-history upload
        self._history_due = False  # a commit since then is not in relaunch/checkpoints.json yet
        self._pending_kept = False  # the store's pending-metrics record holds points or tags
        self._status: str | None = None  # the run status this attempt queued last

    def start(self, start: AttemptStart) -> None:
        """Open the logger (sending starts after the first step), requeue the points an earlier attempt
        left unsent, reopen the run, and set the attempt's tags (earlier attempts' included)."""
        from .client import tracking_uri
        from .runlogger import RunLogger

        self._resumed_from = start.resumed_from
        self.logger = RunLogger(tracking_uri(self.config), self.run_id, defer_start=True, announce=_announce)
        self._requeue_pending_metrics()
        if self.attempt > 1:
            self.logger.set_status("RUNNING")
        attempts = ledger.load_attempts(self.store)
        self.logger.set_tags({"relaunch.attempt": self.attempt, "relaunch.resumed_from_step": start.resumed_from,
                              "relaunch.resumed_from": start.resumed_uri or "none",
                              **attempt_summary_tags(attempts, current=self.attempt)})
        if len(attempts) > 1:  # earlier attempts (a killed one sent nothing itself): their rows and commits
            self.logger.submit(self._log_history)

    def _requeue_pending_metrics(self) -> None:
        """Metric points of steps up to the resumed checkpoint that an earlier attempt may not have
        sent (it was killed with them in its buffer): queue them again; the logger skips those the
        server has. Steps after the checkpoint are recomputed and logged anew."""
        pending = records.read_pending(self.store)
        for step, metrics in pending["points"]:
            if step <= self._resumed_from:
                self.logger.log_metrics(metrics, step)
                self.recent.append([step, metrics])  # kept in the record until the server confirms them
                self._pending_kept = True
        if pending["tags"]:
            self.logger.set_tags(pending["tags"])
            self._pending_kept = True

    def log_params(self, params: dict[str, Any]) -> None:
        self.logger.log_params(params)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if not self._health_shown:
            if any(k.startswith(HEALTH_PREFIX) and v for k, v in metrics.items()):
                self._health_shown = True
            else:
                metrics = {k: v for k, v in metrics.items() if not k.startswith(HEALTH_PREFIX)}
                if not metrics:
                    return
        self.logger.log_metrics(metrics, step)
        self.recent.append([step, metrics])

    def step_done(self, step: int) -> None:
        """Raise what retrying cannot help; start sending after this attempt's first step."""
        if self.logger.fatal:
            raise BadInput(self.logger.fatal)
        if step == self._resumed_from + 2:
            self.logger.start()  # after the first step of this attempt has completed and been timed

    def before_checkpoint(self, step: int) -> None:
        """Persist the points the server has not confirmed (a crash after the commit would lose them)."""
        self._keep_pending(step)

    def _keep_pending(self, step: int, *, all_sent: bool = False) -> None:
        """Write the points the server has not confirmed, and the outage's tags, as the pending record
        (an empty one when ``all_sent``)."""
        self.recent = [p for p in self.recent if p[0] > self.logger.confirmed_step and not all_sent]
        tags = {} if all_sent else self.logger.lost_contact_tags()
        status = None if all_sent else self._status
        records.write_pending_metrics(self.store, step, self.recent, tags, status)
        self._pending_kept = bool(self.recent or tags or status)

    def checkpoint_committed(self, step: int, uri: str, key: str) -> None:
        """Tag the latest checkpoint; rewrite ``relaunch/checkpoints.json`` (retention's deletions included)."""
        self._committed[step] = self.attempt
        self.logger.set_tags({"checkpoint.latest": uri, "checkpoint.latest_step": step})
        self._history_due = True
        if self._history_written is None or time.monotonic() - self._history_written >= CHECKPOINT_HISTORY_SECONDS:
            self._write_history()

    def _write_history(self) -> None:
        self._history_written, self._history_due = time.monotonic(), False
        self.logger.submit(self._log_checkpoints)

    def _log_checkpoints(self, client, run_id: str) -> None:
        """On the logger's thread: the checkpoint history as one artifact."""
        try:
            history = checkpoint_history(self.store, ledger.load_attempts(self.store), self._committed)
        except Exception as err:  # noqa: BLE001 - the store is away: the next commit writes it again
            print(f"relaunch: checkpoint history not logged: {err}", file=sys.stderr)
            return
        client.log_dict(run_id, history, CHECKPOINTS_ARTIFACT)  # an MLflow error here is retried like any send

    def _log_attempts(self, client, run_id: str) -> None:
        """On the logger's thread: every attempt's row as one artifact."""
        try:
            attempts = ledger.load_attempts(self.store)
        except Exception as err:  # noqa: BLE001 - the store is away: the next ending writes it again
            print(f"relaunch: attempt history not logged: {err}", file=sys.stderr)
            return
        client.log_dict(run_id, attempts_table(attempts), ATTEMPTS_ARTIFACT)

    def _log_history(self, client, run_id: str) -> None:
        self._log_attempts(client, run_id)
        self._log_checkpoints(client, run_id)

    def end_attempt(self, end: AttemptEnd) -> None:
        """Finished (exit 0): goodput tags and figure, every attempt's tags, the run FINISHED (the
        pipeline's exit task may still fail it). Else the end reason and exit code, and ``end.status``
        when given (None leaves the run RUNNING for the next attempt)."""
        if self.logger is None:
            return
        if self._history_due:  # before the run's status changes
            self._write_history()
        if end.exit_code == 0:
            self.logger.set_tags({**attempt_summary_tags(ledger.load_attempts(self.store)),
                                  **self._goodput_tags(end.report)})
            self.logger.submit(self._log_attempts)
            self.logger.flush(timeout=FLUSH_SECONDS_BEFORE_PLOT)
            self._log_goodput_artifacts(end.report)
            self._set_status("FINISHED")
            return
        try:  # this attempt's record is final by now; the store may be what failed, though
            attempts = attempt_summary_tags(ledger.load_attempts(self.store))
        except Exception:  # noqa: BLE001 - the next attempt writes these tags again
            attempts = {}
        self.logger.set_tags({**attempts, "relaunch.end_reason": end.reason[:5000],
                              "relaunch.last_exit_code": int(end.exit_code)})
        if not end.told_to_go:  # told to go, the logger has a second or two: the next attempt writes the table
            self.logger.submit(self._log_attempts)
        if end.status:
            self._set_status(end.status)

    def _set_status(self, status: str) -> None:
        self._status = status
        self.logger.set_status(status)

    @staticmethod
    def _goodput_tags(report: dict[str, Any]) -> dict[str, str]:
        tags = {f"goodput.{k}": f"{v:.4g}" if isinstance(v, float) else str(v)
                for k, v in report.items() if isinstance(v, (int, float))}
        overhead = report.get("tracking_overhead") or {}
        if "ratio" in overhead:
            tags["tracking.overhead_ratio"] = f"{overhead['ratio']:.4g}"
        return tags

    def _log_goodput_artifacts(self, report: dict[str, Any]) -> None:
        curve: list[tuple[int, float]] = []
        try:
            if self.logger.connected:  # else: the plot goes without it, at once
                client = self.logger.get_client()
                curve = [(m.step, m.value) for m in client.get_metric_history(self.run_id, "train/loss")]
        except Exception as err:  # noqa: BLE001 - the server is away: the plot goes without its loss curve
            print(f"relaunch: no loss curve for the goodput plot: {err}", file=sys.stderr)
        # the logger uploads from its thread: the folder lives until close() has flushed it
        self._artifacts = self._artifacts or tempfile.TemporaryDirectory(prefix="relaunch-goodput-")
        folder = self._artifacts.name
        with open(os.path.join(folder, "goodput.json"), "w") as fh:
            json.dump(report, fh, indent=2)
        goodput.plot_goodput(report, curve, os.path.join(folder, "goodput.png"))
        self.logger.log_artifact(os.path.join(folder, "goodput.json"), "goodput")
        self.logger.log_artifact(os.path.join(folder, "goodput.png"), "goodput")

    def overhead(self, steps: int, compute_seconds: float) -> dict[str, float]:
        """MLflow logging cost of this attempt per step (caller's time + the sender thread's CPU, which
        competes for the GIL) over the mean step time: the benchmark's "logging overhead" in situ."""
        if self.logger is None:
            return {}
        steps = max(1, steps)
        stats = self.logger.stats
        per_step = (stats.main_thread_seconds + stats.sender_cpu_seconds) / steps
        step = compute_seconds / steps
        return {"seconds_per_step": per_step, "step_seconds": step, "ratio": per_step / step if step else 0.0,
                "main_thread_seconds_per_step": stats.main_thread_seconds / steps,
                "sender_cpu_seconds_per_step": stats.sender_cpu_seconds / steps, "steps": steps}

    def close(self, timeout: float) -> None:
        """Send what is queued within ``timeout``; what the server did not confirm is kept in the pending
        record (and a record whose points all arrived is emptied)."""
        if self.logger is not None:
            if self._history_due:
                self._write_history()
            sent = self.logger.close(timeout=timeout)
            if not sent or self._pending_kept:
                try:
                    self._keep_pending(max((p[0] for p in self.recent), default=self._resumed_from), all_sent=sent)
                except Exception as err:  # noqa: BLE001 - the store is what failed: the next attempt recomputes
                    print(f"relaunch: metric points the tracking server has not confirmed are not kept: {err}",
                          file=sys.stderr)
            if not sent and self.recent and not self.logger.connected:
                _announce(f"relaunch: the tracking server has not confirmed {sum(len(p[1]) for p in self.recent)} "
                          f"metric points; kept in the store ({records.PENDING_METRICS_KEY}): finalize or the next "
                          "`relaunch run --resume` sends them")
        if self._artifacts is not None:
            self._artifacts.cleanup()
            self._artifacts = None


def _announce(line: str) -> None:
    """A line about the tracking server from the training: on stderr, and as a ``tracking`` event
    that ``relaunch run``'s console prints."""
    print(line, file=sys.stderr, flush=True)
    emit(Kind.TRACKING, line=line)


def deliver_pending_metrics(config, store, run_id: str, *, who: str) -> bool:
    """Send the metric points, tags and run status an attempt left in the pending-metrics record (the
    tracking server was away when it ended) into ``run_id``, skipping the points the server holds; empty
    the record once the server took them all. Never raises: what is not sent stays for the next try.
    One line either way (:func:`~relaunch.components.core.tracking.client.say`).

    Args:
        who: the step that delivers, for its line ("prepare", "finalize").

    Returns:
        Whether nothing is left pending.
    """
    from .client import say, tracking_uri
    from .runlogger import RunLogger

    try:
        pending = records.read_pending(store)
    except Exception as err:  # noqa: BLE001 - the store is away: the next step or attempt tries again
        print(f"{who}: pending metric points not read: {err}", file=sys.stderr)
        return False
    points, tags, status = pending["points"], pending["tags"], pending["status"]
    if not points and not tags and not status:
        return True
    logger = RunLogger(tracking_uri(config), run_id, announce=say)
    for step, metrics in points:
        logger.log_metrics(metrics, step)
    if tags:
        logger.set_tags(tags)
    if status:  # the attempt's ending, as it would have told the server (finalize sets the pipeline's after)
        logger.set_status(status)
    count = sum(len(metrics) for _, metrics in points)
    if not logger.close(DELIVERY_SECONDS):
        say(f"{who}: the tracking server did not take the {count} metric points the training left unsent "
            f"({logger.fatal or 'no answer'}); they stay in {records.PENDING_METRICS_KEY} for the next try")
        return False
    try:
        records.write_pending_metrics(store, max((s for s, _ in points), default=-1), [])
    except Exception as err:  # noqa: BLE001 - sent anyway: a later delivery skips what the server holds
        print(f"{who}: {records.PENDING_METRICS_KEY} not emptied: {err}", file=sys.stderr)
    steps = f" (steps {points[0][0]}..{points[-1][0]})" if points else ""
    say(f"{who}: sent the {count} metric points{steps} the training left unsent ({records.PENDING_METRICS_KEY}) "
        f"to MLflow run {run_id}")
    return True
