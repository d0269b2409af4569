"""The trials of a study on this machine: ``tune.parallel`` at once, each one the launch step
(``python -m relaunch.components.launch``, the step ``relaunch run`` runs) in a process group of its own,
so that it can be stopped with its torchrun agents and workers, and so that its torchrun restarts and
its resume from its own checkpoints work as in a single training.

While a trial runs, its rank 0 appends a line per validation to the trial's metrics file
(``RELAUNCH_METRICS_FILE``, :mod:`relaunch.components.core.trainer.metrics_file`); :class:`StudyRunner`
tails it, reports the objective metric to Optuna and asks the pruner. A pruned trial is sent SIGTERM (the
training commits its checkpoint and exits 143) and ends PRUNED, never retried. A trial that exits with a
retryable code of the contract (137, 138, 143, 130: a kill, a transient failure, a preemption) is
started again in the same folder, up to ``tune.trial_retries`` times, and resumes from its own last
checkpoint; a permanent code (a user error, 2) fails the trial, not the study.

The study starts one zygote (:mod:`relaunch.components.core.runtime.zygote`) that imports torch and the
task once: every trial's workers, and each one torchrun restarts, are forks of it, as the workers of a
``relaunch run`` are forks of its warm server's. ``RELAUNCH_COLD`` set: no zygote, every worker a fresh
interpreter.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ...components.core.contract import events
from ...components.core.contract.config import RelaunchConfig
from ...components.core.contract.events import Kind
from ...components.core.contract.exitcodes import ExitCode, normalize
from ...components.core.runtime.zygote import Zygote
from ...components.core.store.records import read_exit_record, read_summary
from ...components.core.tracking.context import Context
from ...components.core.trainer.metrics_file import METRICS_FILE_ENV, read_new
from ...components.core.tuning.study_folder import (COMPLETE, FAILED, METRICS_LOG, PRUNED, TrialRecord, metrics_path,
                                                    read_trial, write_trial)
from ...components.core.tuning.study import PruneVerdict, Study
from ...components.core.tuning.trials import (StartedTrial, begin_trial, check_objective_metric, end_trial,
                                              interrupted_trial_run, objective, retryable_end)
from ...components.core.store.ledger import completed
from ...components.launchers.jobs import TRAIN_MODULE
from ...components.launchers.local import COLD_ENV
from .study_console import TuneConsole

POLL_SECONDS = 0.1
"""How often the study looks at its trials: their validation lines, events and ends."""
STOP_MARGIN_SECONDS = 10.0
"""Beyond the preemption grace: how long a stopped trial gets to commit its checkpoint and end."""
LAUNCH_LOG = "launch.log"
EVENTS_FILE = "events.jsonl"


@dataclass
class TrialProcess:
    """One trial while it runs: its launch step's process, the files it writes, what it reported."""

    started: StartedTrial
    folder: Path
    """The trial's local folder: its metrics file, its launch step's log and events."""
    proc: subprocess.Popen | None = None
    metrics_offset: int = 0
    events_offset: int = 0
    replay_until: int = 0
    """Validation lines before this offset are an earlier run's (a resumed trial): reported to Optuna, not printed."""
    reported: dict[int, dict[str, float]] = field(default_factory=dict)
    verdict: PruneVerdict | None = None
    began: float = field(default_factory=time.time)
    stopped: bool = False

    @property
    def number(self) -> int:
        return self.started.record.number

    @property
    def metrics_file(self) -> Path:
        return self.folder / METRICS_LOG


class StudyRunner:
    """Runs the trials of ``study`` that have not ended, ``tune.parallel`` at once, until each ended.

    Args:
        config: the study's prepared configuration (its ``data.version`` and MLflow run set).
        study: the open Optuna study.
        study_store: the study's folder in the store.
        local_dir: the study's local folder (the trials' metrics files, logs and events).
        parent_run_id: the study's MLflow run, the parent of each trial's.
        view: where the lines go.
    """

    def __init__(self, config: RelaunchConfig, study: Study, study_store, local_dir: Path, parent_run_id: str,
                 view: TuneConsole):
        self.config, self.study, self.study_store = config, study, study_store
        self.local_dir, self.parent_run_id, self.view = local_dir, parent_run_id, view
        self.tune = config.tune
        self.running: list[TrialProcess] = []
        self.stopping = False
        self.stopped: list[tuple[TrialRecord, Context]] = []
        """The trials :meth:`stop` stopped: their records (still ``running``) and configurations."""
        self.zygote_env: dict[str, str] = {}

    # ---- the loop

    def run(self) -> list[TrialRecord | None]:
        """Run every trial that has not ended; the trials' records at the end. On any exception (an
        interrupt, a bad objective metric) the running trials are stopped first (:meth:`stop`).

        Raises:
            BadInput: ``tune.objective.metric`` is not a validation metric of the task.
        """
        queue = []
        for number in range(self.tune.trials):
            record = read_trial(self.study_store, number)
            if record is not None and record.final:
                self.view.skipped(number, record.state, record.value, self.tune.objective.metric)
            else:
                queue.append(number)
        with self._zygote(queue):
            try:
                while queue or self.running:
                    while queue and len(self.running) < self.tune.parallel:
                        self._start(queue.pop(0))
                    for trial in list(self.running):
                        self._poll(trial)
                    time.sleep(POLL_SECONDS)
            except BaseException:
                self.stop()
                raise
        return [read_trial(self.study_store, n) for n in range(self.tune.trials)]

    @contextlib.contextmanager
    def _zygote(self, queue: list[int]):
        """The study's zygote while its trials run (its log in the study's folder); none cold, with no trial
        to run, or for a backend other than the local agents (Ray starts its own workers)."""
        if os.environ.get(COLD_ENV) or not queue or self.config.launch.backend != "local":
            yield
            return
        with open(self.local_dir / "zygote.log", "a") as log, \
                tempfile.TemporaryDirectory(prefix="relaunch-study-") as directory:  # a unix socket's path is short
            zygote = Zygote(os.path.join(directory, "zygote.sock"),
                            (TRAIN_MODULE, self.config.train.task.split(":")[0]), log=log)
            self.zygote_env = zygote.env
            try:
                yield
            finally:
                self.zygote_env = {}
                zygote.close()

    def _start(self, number: int) -> None:
        started = begin_trial(self.study, self.config, self.study_store, number, parent_run_id=self.parent_run_id)
        folder = metrics_path(self.local_dir, number).parent
        folder.mkdir(parents=True, exist_ok=True)
        trial = TrialProcess(started=started, folder=folder)
        trial.replay_until = trial.metrics_file.stat().st_size if trial.metrics_file.exists() else 0
        trial.events_offset = (folder / EVENTS_FILE).stat().st_size if (folder / EVENTS_FILE).exists() else 0
        self.view.started(number, started.record.params, started.record.run_id, started.resumed)
        self._launch(trial)
        self.running.append(trial)

    def _launch(self, trial: TrialProcess) -> None:
        cmd = [sys.executable, "-m", "relaunch.components.launch", "--config-json", trial.started.config.to_json(),
               "--input", f"pipeline_run_id={self.study.name}-trial-{trial.number}"]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", METRICS_FILE_ENV: str(trial.metrics_file),
               events.EVENTS_ENV: str(trial.folder / EVENTS_FILE), **self.zygote_env}
        with open(trial.folder / LAUNCH_LOG, "a") as log:
            log.write(f"--- relaunch tune: trial {trial.number} launched at {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}\n")
            log.flush()
            trial.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                          start_new_session=True)

    # ---- while a trial runs

    def _poll(self, trial: TrialProcess) -> None:
        self._read_validations(trial)
        self._read_events(trial)
        if trial.proc is not None and trial.proc.poll() is not None:
            self._read_validations(trial)  # its last lines, written before it ended
            self._ended(trial, normalize(trial.proc.returncode))

    def _read_validations(self, trial: TrialProcess) -> None:
        start = trial.metrics_offset
        found, trial.metrics_offset = read_new(trial.metrics_file, trial.metrics_offset)
        replayed = start < trial.replay_until
        for step, metrics in found:
            if step in trial.reported:
                continue  # validated again by an attempt that resumed before it: the same values
            check_objective_metric(self.config, metrics)
            trial.reported[step] = metrics
            if not replayed and trial.verdict is None:
                self.view.reported(trial.number, step, metrics)
            if trial.verdict is None and not trial.stopped:
                verdict = self.study.report(trial.started.trial, step, metrics[self.tune.objective.metric])
                if verdict is not None:
                    trial.verdict = verdict
                    self.view.pruned(trial.number, step, verdict.describe(self.tune.objective.metric,
                                                                          self.tune.objective.direction))
                    self._signal(trial, signal.SIGTERM)

    def _read_events(self, trial: TrialProcess) -> None:
        path = trial.folder / EVENTS_FILE
        if not path.exists():
            return
        found, trial.events_offset = events.read_file(path, trial.events_offset)
        for event in found:
            attempt = int(event.get("attempt", 1) or 1)
            if event.kind == Kind.RESUMED and (attempt > 1 or int(event.get("step", -1)) >= 0):
                self.view.attempt(trial.number, attempt, int(event.get("step", -1)))

    # ---- a trial's end

    def _ended(self, trial: TrialProcess, code: int) -> None:
        self.running.remove(trial)
        self._sweep(trial)
        store = trial.started.context.store
        summary = read_summary(store) or {}
        record = trial.started.record
        seconds = time.time() - trial.began
        if self.stopping and not (code == ExitCode.OK and completed(summary)):
            return  # stopped with the study: its record stays running, a resume continues it
        if trial.verdict is not None and not (code == ExitCode.OK and completed(summary)):
            end_trial(self.study, trial.started, self.study_store, state=PRUNED, value=trial.verdict.value,
                      step=trial.verdict.step, exit_code=code, reason=f"pruned at step {trial.verdict.step}")
            self.view.ended_pruned(trial.number, trial.verdict.step, code)
            return
        if code == ExitCode.OK:
            found = objective(trial.started.context, trial.reported) if completed(summary) else None
            if found is None:
                why = (f"the training ended at step {summary.get('last_step')} of {summary.get('total_steps')} "
                       f"without reaching its end" if not completed(summary) else
                       f"no value of {self.tune.objective.metric} was reported")
                end_trial(self.study, trial.started, self.study_store, state=FAILED, exit_code=code, reason=why)
                self.view.failed(trial.number, code, why)
                return
            value, step = found
            end_trial(self.study, trial.started, self.study_store, state=COMPLETE, value=value, step=step, exit_code=0)
            self.view.completed(trial.number, self.tune.objective.metric, value, step, seconds)
            return
        if retryable_end(code) and record.retries < self.tune.trial_retries:
            record.retries += 1
            write_trial(self.study_store, record)
            self.view.retrying(trial.number, code, record.retries, self.tune.trial_retries)
            self._launch(trial)
            self.running.append(trial)
            return
        reason = self._reason(trial, store, code)
        if retryable_end(code):
            reason = f"{reason} (its {self.tune.trial_retries} retries spent)"
        end_trial(self.study, trial.started, self.study_store, state=FAILED, exit_code=code, reason=reason)
        self.view.failed(trial.number, code, reason)

    def _reason(self, trial: TrialProcess, store, code: int) -> str:
        """The launch step's own line (``launch: error: ...``), else the trainer's exit record."""
        try:
            lines = (trial.folder / LAUNCH_LOG).read_text(errors="replace").splitlines()
        except OSError:
            lines = []
        said = next((line.split(": error: ", 1)[1] for line in reversed(lines) if line.startswith("launch: error: ")), "")
        if said:
            return said[:300]
        record = read_exit_record(store) or {}
        return str(record.get("reason") or f"the launch step ended with exit code {code}")[:300]

    # ---- stopping

    def _signal(self, trial: TrialProcess, sig: int) -> None:
        trial.stopped = trial.stopped or sig == signal.SIGTERM
        if trial.proc is not None and trial.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(trial.proc.pid, sig)

    def _sweep(self, trial: TrialProcess) -> None:
        """Kill what the trial's launch step left behind (an agent started in the moment the step was
        stopped): every descendant of this process that trains into the trial's metrics file."""
        import psutil

        mine = str(trial.metrics_file)
        with contextlib.suppress(psutil.Error):
            for process in psutil.Process().children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    if process.environ().get(METRICS_FILE_ENV) == mine:
                        process.kill()

    def stop(self) -> None:
        """Stop every running trial (SIGTERM: each commits its checkpoint and exits 143; SIGKILL after the
        preemption grace and a margin); their records stay ``running``, their Optuna trials are told
        FAIL, their MLflow runs say ``interrupted``, and a resumed study continues them in their folders
        (:attr:`stopped` lists them)."""
        if self.stopping:
            return
        self.stopping = True
        stopped = list(self.running)
        for trial in stopped:
            self._signal(trial, signal.SIGTERM)
        deadline = time.monotonic() + self.config.train.preempt_grace_seconds + STOP_MARGIN_SECONDS
        while time.monotonic() < deadline and any(t.proc.poll() is None for t in stopped if t.proc is not None):
            time.sleep(POLL_SECONDS)
        for trial in stopped:
            self._signal(trial, signal.SIGKILL)
            if trial.proc is not None:
                trial.proc.wait()
            self._sweep(trial)
        for trial in stopped:  # the storage or the server away: a resume says it again
            with contextlib.suppress(Exception):
                self.study.fail(trial.started.trial.number)
            with contextlib.suppress(Exception):
                interrupted_trial_run(trial.started.context, trial.started.record)
        self.running = []
        self.stopped = [(t.started.record, t.started.context) for t in stopped]
