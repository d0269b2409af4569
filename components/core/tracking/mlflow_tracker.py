"""The MLflow tracker (:class:`~components.core.tracking.trackers.Tracker`): the training's MLflow run,
fed through the asynchronous :class:`~components.core.tracking.runlogger.RunLogger`, and the
pending-metrics record that carries unsent metric points across a crash.

What the run holds, kept true across restarts:

- ``checkpoint.step-<12 digits>`` (the folder's own name) for each committed checkpoint; when retention
  deletes one, its tag becomes ``deleted by retention: <uri>``; ``checkpoint.latest`` and
  ``checkpoint.latest_step``;
- ``relaunch.attempt.<n>.*`` for every attempt (start, end, exit code, last step, resumed-from step),
  the killed ones included, and ``relaunch.restarts``;
- the goodput report as ``goodput.*`` tags (single numbers, not one-point metric series) plus the
  ``goodput/goodput.png`` figure and ``goodput/goodput.json``.

An unreachable server never stops the training: the logger buffers and retries on its own thread;
only what retrying cannot help (refused credentials, :attr:`RunLogger.fatal`) is raised, as bad input.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Any

from components.core.contract.errors import BadInput
from components.core.store import records
from components.core.tracking import goodput
from components.core.tracking.trackers import AttemptEnd, AttemptStart, TrackerBase

CHECKPOINT_TAG_PREFIX = "checkpoint."
DELETED_BY_RETENTION = "deleted by retention: "
FLUSH_SECONDS_BEFORE_PLOT = 30.0


def checkpoint_tag(key: str) -> str:
    """``checkpoint.step-000000000038``: the tag of a checkpoint is its folder's name (one step format)."""
    return CHECKPOINT_TAG_PREFIX + key.rstrip("/").rsplit("/", 1)[-1]


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
        self._artifacts: tempfile.TemporaryDirectory | None = None  # files the logger uploads; removed at close

    def start(self, start: AttemptStart) -> None:
        """Open the logger (sending starts after the first step), requeue the points an earlier attempt
        left unsent, reopen the run, and set the attempt's tags (earlier attempts' included)."""
        from components.core.checkpoint import step_key
        from components.core.tracking.client import tracking_uri
        from components.core.tracking.runlogger import RunLogger

        self._resumed_from = start.resumed_from
        self.logger = RunLogger(tracking_uri(self.config), self.run_id, defer_start=True)
        self._requeue_pending_metrics()
        if self.attempt > 1:
            self.logger.set_status("RUNNING")
        attempts = goodput.load_attempts(self.store)
        # an earlier attempt killed before its logger sent anything: its commits are in its record
        earlier = sorted({int(s) for a in attempts if a.attempt != self.attempt for s in a.commits})
        self.logger.set_tags({"relaunch.attempt": self.attempt, "relaunch.resumed_from_step": start.resumed_from,
                              f"relaunch.attempt.{self.attempt}.resumed_from_step": start.resumed_from,
                              f"relaunch.attempt.{self.attempt}.world_size": start.world_size,
                              "relaunch.resumed_from": start.resumed_uri or "none",
                              **{checkpoint_tag(step_key(s)): self.store.uri_for(step_key(s)) for s in earlier},
                              **goodput.attempt_tags(attempts, current=self.attempt)})
        if earlier:
            self.logger.submit(self._mark_deleted_checkpoints)

    def _requeue_pending_metrics(self) -> None:
        """Metric points of steps up to the resumed checkpoint that an earlier attempt may not have
        sent (it was killed with them in its buffer): queue them again; the logger skips those the
        server has. Steps after the checkpoint are recomputed and logged anew."""
        for step, metrics in records.read_pending_metrics(self.store):
            if step <= self._resumed_from:
                self.logger.log_metrics(metrics, step)

    def log_params(self, params: dict[str, Any]) -> None:
        self.logger.log_params(params)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
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
        self.recent = [p for p in self.recent if p[0] > self.logger.confirmed_step]
        records.write_pending_metrics(self.store, step, self.recent)

    def checkpoint_committed(self, step: int, uri: str, key: str) -> None:
        """Tag a committed checkpoint, and mark the tags of checkpoints retention has deleted since."""
        self.logger.set_tags({checkpoint_tag(key): uri, "checkpoint.latest": uri, "checkpoint.latest_step": step})
        self.logger.submit(self._mark_deleted_checkpoints)

    def _mark_deleted_checkpoints(self, client, run_id: str) -> None:
        """On the logger's thread: every ``checkpoint.step-*`` (and the resumed-from) tag whose folder is
        gone gets the value ``deleted by retention: <uri>``."""
        from mlflow.entities import RunTag

        from components.core.checkpoint import checkpoint_steps, parse_checkpoint_uri

        try:
            existing = set(checkpoint_steps(self.store))
        except Exception as err:  # noqa: BLE001 - the store is away: the next commit reconciles again
            print(f"relaunch: checkpoint tags not reconciled: {err}", file=sys.stderr)
            return
        tags = client.get_run(run_id).data.tags  # an MLflow error here is retried like any send
        stale = {}
        for key, value in tags.items():
            if not (key.startswith(CHECKPOINT_TAG_PREFIX + "step-") or key == "relaunch.resumed_from"):
                continue
            if value.startswith(DELETED_BY_RETENTION) or "/checkpoints/step-" not in value:
                continue
            try:
                root, step = parse_checkpoint_uri(value)
            except BadInput:
                continue
            if step not in existing and root.rstrip("/") == self.store.uri.rstrip("/"):
                stale[key] = DELETED_BY_RETENTION + value
        if stale:
            client.log_batch(run_id, tags=[RunTag(k, v) for k, v in stale.items()])

    def end_attempt(self, end: AttemptEnd) -> None:
        """Finished (exit 0): goodput tags and figure, every attempt's tags, the run FINISHED (the
        pipeline's exit task may still fail it). Else the end reason and exit code, and ``end.status``
        when given (None leaves the run RUNNING for the next attempt)."""
        if self.logger is None:
            return
        if end.exit_code == 0:
            self.logger.set_tags({**goodput.attempt_tags(goodput.load_attempts(self.store)),
                                  **self._goodput_tags(end.report)})
            self.logger.flush(timeout=FLUSH_SECONDS_BEFORE_PLOT)
            self._log_goodput_artifacts(end.report)
            self.logger.set_status("FINISHED")
            return
        try:  # this attempt's record is final by now; the store may be what failed, though
            attempts = goodput.attempt_tags(goodput.load_attempts(self.store))
        except Exception:  # noqa: BLE001 - the next attempt writes these tags again
            attempts = {}
        self.logger.set_tags({**attempts, "relaunch.end_reason": end.reason[:5000],
                              f"relaunch.attempt.{self.attempt}.exit_code": int(end.exit_code)})
        if end.status:
            self.logger.set_status(end.status)

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
        if self.logger is not None:
            self.logger.close(timeout=timeout)
        if self._artifacts is not None:
            self._artifacts.cleanup()
            self._artifacts = None
