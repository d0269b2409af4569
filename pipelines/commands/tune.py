"""``relaunch tune --config FILE [--set key=value ...] [--study NAME] [--resume]``: a study of trainings
on this machine, with Optuna: the configuration's ``tune:`` section says the search space, the objective,
the number of trials and how many run at once, the sampler and its seed, the pruner.

    relaunch tune --config configs/tune.yaml               # a new study (make tune)
    relaunch tune --config configs/tune.yaml --resume      # continue the newest study (after Ctrl-C, a crash)
    relaunch tune --config configs/tune.yaml --study lr-width --set tune.trials=8
    relaunch tune --set tune.space.train.lr='{type: log_uniform, low: 0.001, high: 0.3}' --set tune.trials=4

What happens: prepare runs once (the dataset, the study's MLflow run, its stored configuration in
``<store.uri>/studies/<study>/``); then the trials, ``tune.parallel`` at once, each a relaunch training
in its own folder ``studies/<study>/trials/<n>/`` run through the launch step, with its own torchrun
restarts, checkpoints and resume (:mod:`relaunch.pipelines.tune.trial_runner`); then the best trial's last
checkpoint goes through the evaluate and register steps, as a single training's does. A line per trial
start, validation, resume, retry, pruning and end (:mod:`relaunch.pipelines.tune.study_console`).

A study is named by ``--study`` or ``tune.study``; without either, each ``relaunch tune`` starts a new
study named ``<name>-<UTC time>`` and ``--resume`` continues the newest. A name that exists is refused
without ``--resume`` (one line, exit 2). ``--resume`` continues the study with its stored configuration
(the identity rules of ``relaunch run --resume``: a ``--set`` that changes what its trainings are, or its
space, objective, sampler or pruner, is refused in one line, exit 2; ``tune.trials`` may grow): trials
that ended are not run again, trials that were running resume from their own checkpoints in their own
folders and MLflow runs. One ``relaunch tune`` per study at a time (its lock, as ``relaunch run``'s).

Ctrl-C (SIGINT) or SIGTERM stops every trial (each commits its checkpoint: SIGTERM to its launch step)
and ends with one line: exit 143 when each stopped trial committed its checkpoint at the step it stopped
at, else 130. A ``relaunch tune`` killed outright leaves nothing running (the guardian of
:mod:`relaunch.pipelines.local.interrupt`); ``--resume`` continues it.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time

from pydantic import ValidationError

from ...components.core.contract.config import RelaunchConfig, describe_validation_error
from ...components.core.contract.config_loading import config_from_cli
from ...components.core.contract.uris import expand_home
from ...components.core.contract.errors import BadInput, RelaunchError
from ...components.core.contract.exitcodes import ExitCode
from ...components.core.store.pipeline_lock import PipelineLock, TrainingInUse, describe_holder
from ...components.core.store.records import (PIPELINE_LOCK_KEY, read_json, read_summary, read_training_config,
                                              stored_run_id)
from ...components.core.tracking.context import Context
from . import Subcommands

STEPS_LOG = "tune.log"
"""In the study's local folder: the output of the steps ``relaunch tune`` runs in its own process."""


def add_parser(sub: Subcommands, help_text: str) -> None:
    p = sub.add_parser("tune", help=help_text, description=help_text)
    p.add_argument("--config", help="YAML configuration file with a tune: section (e.g. configs/tune.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one field, e.g. --set tune.trials=8 or "
                        "--set tune.space.train.lr='{type: log_uniform, low: 0.001, high: 0.3}' (repeatable)")
    p.add_argument("--study", metavar="NAME", help="the study's name (kebab-case; default: tune.study, else a new "
                                                    "<name>-<UTC time>, and --resume takes the newest)")
    p.add_argument("--resume", action="store_true",
                   help="continue the study with its stored configuration: ended trials are not run again, running "
                        "ones resume from their checkpoints")
    p.add_argument("--state-dir", default=".relaunch",
                   help="where a study whose store is not a local folder keeps its local files (the sqlite Optuna "
                        "storage, the trials' metrics files and logs)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """``relaunch tune``; Ctrl-C (SIGINT) or SIGTERM stops every trial and ends with one line (130 or 143)."""
    from ..local.interrupt import Interrupted, interruptible

    config = _with_study(config_from_cli(args.config, None, args.overrides), args.study)
    check_tune_section(config)
    session = TuneSession(args, config)
    with interruptible():
        try:
            return session.run()
        except Interrupted as stop:
            code, line = session.interrupted(stop)
            print(line, file=sys.stderr)
            return code


def _with_study(config: RelaunchConfig, study: str | None) -> RelaunchConfig:
    if not study:
        return config
    try:
        config.tune.study = study
    except ValidationError as err:
        raise BadInput(f"--study: {describe_validation_error(err).split(': ', 2)[-1]}") from None
    return config


def check_tune_section(config: RelaunchConfig) -> None:
    """Refuse a study that cannot run here, before anything starts (the config model checked the rest).

    Raises:
        BadInput: an empty ``tune.space``.
    """
    if not config.tune.space:
        raise BadInput("tune.space is empty: name at least one field to search, e.g. --set "
                       "tune.space.train.lr='{type: log_uniform, low: 0.001, high: 0.3}' (configs/tune.yaml has one)")


class TuneSession:
    """One ``relaunch tune``: choose the study, take its lock, prepare, run the trials, evaluate and
    register the best, close the study's MLflow run."""

    def __init__(self, args: argparse.Namespace, config: RelaunchConfig):
        self.args, self.config = args, config
        self.root = Context(config)  # the root of studies
        self.study: Context | None = None  # the study folder's, once its lock is taken
        self.name = ""
        self.study_config: RelaunchConfig | None = None  # once prepared
        self.runner = None
        self.started = time.time()
        self.local_dir = None  # the study's local folder (layout.local_study_dir), once chosen
        self.experiment_id = ""

    def run(self) -> int:
        from ...components.prepare import check_inputs
        from ...components.core.tuning.trials import check_validation_metric
        from ..local.interrupt import Interrupted

        check_validation_metric(self.config)  # first: the checks that write nothing, then the store's probe
        state_dir = _state_dir(self.args.state_dir)
        name, resuming = self._choose_study(self.root.store)
        check_inputs(self.config)
        with contextlib.ExitStack() as held:
            try:
                self.name = self._take_study(name, resuming, held)
                return self._run(resuming, held, state_dir)
            except Interrupted:
                held.pop_all()  # kept until this process ends: no resume starts while its trials stop
                raise

    def _run(self, resuming: bool, held: contextlib.ExitStack, state_dir: str) -> int:
        from rich.console import Console

        from ...components.core.tuning.study_folder import (StudyRecord, default_storage, local_study_dir, read_study,
                                                            study_uri, trial_records, write_study)
        from ...components.core.tuning.trials import storage_for_records, study_configuration
        from ..tune.study_console import TuneConsole

        uri = study_uri(self.config.store.uri, self.name)
        study_store = self.study.store
        view = TuneConsole(Console(file=sys.stdout))
        record = read_study(study_store)
        config = self.config
        if resuming:
            config = study_configuration(config, read_training_config(study_store), self.name)
            if record is not None and record.state == "finished" and all(
                    r is not None and r.final for r in trial_records(study_store, config.tune.trials)):
                print(f"relaunch: the study {self.name} finished (best trial {record.best_trial}, "
                      f"{config.tune.objective.metric} {record.best_value}; {record.registered or 'nothing registered'}); "
                      f"nothing to do — --set tune.trials=N with more trials continues it, `relaunch tune --study "
                      f"NEW-NAME` starts another", flush=True)
                return 0
        config = config.model_copy(deep=True)
        config.tune.study = self.name
        config.store.uri = uri
        config.tracking.run_id = stored_run_id(study_store) if resuming else None
        config.tracking.run_name = config.tracking.run_name or self.name
        local_dir = self.local_dir = local_study_dir(self.config.store.uri, self.name, state_dir)
        storage = config.tune.storage or default_storage(local_dir)
        if record is None:
            write_study(study_store, StudyRecord(name=self.name, storage=storage if not config.tune.storage else "tune.storage"))
        view.header(self.name, uri, config.tune, resuming)
        self.study = self.study.for_config(config)  # the same folder: the same store
        self.study_config = config
        prepared = self._prepare(config, storage_for_records(storage) if config.tune.storage else None, view)
        self.study_config = prepared
        return self._trials_and_best(prepared, study_store, local_dir, storage, view)

    def _choose_study(self, root) -> tuple[str, bool]:
        """The study's name and whether it is resumed; reads only. A new study without a name gets
        ``<name>-<UTC time>`` (a suffix when that is taken: :meth:`_take_study`).

        Raises:
            BadInput: ``--resume`` of no study, or a new study of a name that exists.
        """
        from ...components.core.tuning.study_folder import study_names

        names = study_names(root)
        explicit = self.config.tune.study
        if self.args.resume:
            if explicit is None and not names:
                raise BadInput(f"--resume: {self.config.store.uri} holds no study to resume; `relaunch tune` starts one")
            name = explicit or names[-1]
            if name not in names:
                hint = f"; its studies, newest last: {', '.join(names[-5:])}" if names else ""
                raise BadInput(f"--resume: no study {name!r} in {self.config.store.uri}{hint}; "
                               f"`relaunch tune --study {name}` starts it")
            return name, True
        if explicit is not None:
            if explicit in names:
                raise BadInput(f"the study {explicit!r} exists in {self.config.store.uri}; `relaunch tune --resume "
                               f"--study {explicit}` continues it, or name a new one with --study")
            return explicit, False
        return f"{self.config.name[:23]}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}", False

    def _take_study(self, name: str, resuming: bool, held: contextlib.ExitStack) -> str:
        """Take the study's lock into ``held`` (the first write); the study's name (a generated one gets
        a suffix when another new study took it a moment ago).

        Raises:
            TrainingInUse: a live ``relaunch tune`` runs this study (one line, exit 2).
        """
        from ...components.core.tuning.study_folder import study_names

        if resuming or self.config.tune.study is not None:
            self.study = self._study_context(name)
            held.enter_context(self._lock(self.study.store, name))
            return name
        n, candidate = 1, name
        while True:
            if candidate not in study_names(self.root.store):
                study = self._study_context(candidate)
                try:
                    held.enter_context(self._lock(study.store, candidate))
                    self.study = study
                    return candidate
                except TrainingInUse:
                    pass  # another new study took this name a moment ago
            n += 1
            candidate = f"{name}-{n}"

    def _study_context(self, name: str) -> Context:
        """The context of the study ``name``'s folder: the configuration with its ``store.uri``."""
        from ...components.core.tuning.study_folder import study_uri

        at = self.config.model_copy(deep=True)
        at.store.uri = study_uri(self.config.store.uri, name)
        return Context(at)

    @staticmethod
    def _lock(study_store, name: str):
        """The study's lock, taken (what keeps a second ``relaunch tune`` of it from starting).

        Raises:
            TrainingInUse: a live process holds it (one line, exit 2).
        """
        try:
            return PipelineLock(study_store, name, command="relaunch tune").take()
        except TrainingInUse:
            holder = read_json(study_store, PIPELINE_LOCK_KEY) or {}
            raise TrainingInUse(f"the study {name} is being run by {describe_holder(holder)}; one relaunch tune of "
                                f"a study at a time: wait for it to end, or stop it (kill {holder.get('pid')}), then "
                                f"`relaunch tune --resume --study {name}`") from None

    @contextlib.contextmanager
    def _steps_log(self):
        """What the steps run here (prepare, evaluate, register) and their libraries print goes to the
        study's ``tune.log``, as ``relaunch run`` keeps its steps' output in its ``pipeline.log``."""
        self.local_dir.mkdir(parents=True, exist_ok=True)
        with open(self.local_dir / STEPS_LOG, "a", buffering=1) as log, contextlib.redirect_stdout(log), \
                contextlib.redirect_stderr(log):
            yield

    def _prepare(self, config: RelaunchConfig, storage_shown: str | None, view) -> RelaunchConfig:
        """The prepare step on the study's folder: the dataset, the study's MLflow run (created, or the
        stored one reopened), the study's stored configuration (refused when another one is stored)."""
        from ...components import prepare
        from ...components.core.tracking.client import call
        from ...components.core.tuning.trials import STUDY_TAG

        began = time.time()
        shown = config.model_copy(deep=True)
        shown.tune.storage = storage_shown  # its password never stored nor logged
        with self._steps_log():
            out = prepare.run(shown)
        prepared = RelaunchConfig.from_json(out.config_json)
        prepared.tune.storage = config.tune.storage
        self.study = self.study.for_config(prepared)
        call("tag the study's run", self.study.tracker.set_tag, out.run_id, STUDY_TAG, self.name)
        view.prepared(out.dataset_version, out.run_id, time.time() - began)
        self.experiment_id = out.experiment_id
        return prepared

    def _trials_and_best(self, config: RelaunchConfig, study_store, local_dir, storage: str, view) -> int:
        from ...components.core.tracking.client import mark_run_finished
        from ...components.core.tuning.study_folder import read_study, write_study
        from ...components.core.tuning.report import log_study
        from ...components.core.tuning.study import Study
        from ...components.core.tuning.trials import best_trial
        from ..tune.trial_runner import StudyRunner

        study = Study(config, storage)
        self.runner = StudyRunner(config, study, study_store, local_dir, config.tracking.run_id, view)
        records = self.runner.run()
        best = best_trial(records, config.tune.objective.direction)
        registered, code = "", 0
        if best is None:
            failed = [r for r in records if r is not None and r.state == "failed" and r.exit_code]
            codes = sorted({int(r.exit_code) for r in failed})
            code = codes[0] if len(codes) == 1 else int(ExitCode.BUG) if codes else 0
            view.not_registered("no trial completed")
        else:
            view.best(best.number, config.tune.objective.metric, best.value, best.params)
            registered = self._evaluate_and_register(config, best, view)
        log_study(config, config.tracking.run_id, records, best, study.param_importances(),
                  {"relaunch.registered": registered} if registered else None)
        status = "FINISHED" if best is not None else "FAILED"
        mark_run_finished(config, config.tracking.run_id, status, "" if best is not None else "no trial completed")
        record = read_study(study_store)
        record.state = "finished" if best is not None else "failed"
        record.best_trial, record.best_value = (best.number, best.value) if best is not None else (None, None)
        record.registered = registered
        write_study(study_store, record)
        self._summary(config, records, best, registered, storage, view)
        if code:
            print(f"relaunch: error: no trial of the study {self.name} completed (exit {code})", file=sys.stderr)
        return code

    def _evaluate_and_register(self, config: RelaunchConfig, best, view) -> str:
        """The best trial's last checkpoint through the evaluate step and, when its gate passes, the
        register step (the champion comparison), as a single training's: its version linked to the
        trial's MLflow run. What was registered (``relaunch-digits v3``), or why not."""
        from ...components import evaluate, register
        from ...components.core.tuning.trials import trial_config

        trial = trial_config(config, best.number, best.params, study_store_uri=config.store.uri, run_id=best.run_id)
        began = time.time()
        with self._steps_log():
            ev = evaluate.run(trial, training_completed=True)
        view.evaluated(ev.metrics_json, ev.step, ev.passed, time.time() - began)
        if not ev.passed:
            why = (f"the evaluation gate failed ({config.evaluate.gate_metric} < {config.evaluate.gate_min:g})")
            view.not_registered(why)
            return f"not registered: {why}"
        began = time.time()
        with self._steps_log():
            reg = register.run(trial, ev.checkpoint_uri, ev.metrics_json)
        view.registered(reg.model_name, reg.version, reg.aliases, reg.champion_decision, time.time() - began)
        return f"{reg.model_name} v{reg.version}"

    def _summary(self, config: RelaunchConfig, records, best, registered: str, storage: str, view) -> None:
        from ...components.core.tracking.lineage import run_url
        from ...components.core.tuning.trials import storage_for_records

        done = [r for r in records if r is not None]
        counts = ", ".join(f"{sum(r.state == s for r in done)} {s}" for s in ("complete", "pruned", "failed"))
        browse = "open" if config.tracking.uri.startswith(("http://", "https://")) else "make ui, then open"
        rows = [("study", f"{self.name} in {config.store.uri}"),
                ("MLflow run", f"{config.tracking.run_id} (one child run per trial) — {browse} "
                               f"{run_url(config, config.tracking.run_id, self.experiment_id)}"),
                ("trials", f"{len(done)} of {config.tune.trials}: {counts}")]
        if best is not None:
            rows.append(("best", f"trial {best.number}: {config.tune.objective.metric} {best.value:.4f} "
                                 f"(MLflow run {best.run_id}) in {config.store.uri}/trials/{best.number}"))
        rows.append(("model", registered or "not registered"))
        rows.append(("Optuna storage", storage_for_records(storage)))
        rows.append(("took", f"{time.time() - self.started:.1f}s"))
        view.summary(rows)

    def interrupted(self, stop) -> tuple[int, str]:
        """The exit code and the one line of a study stopped by signal, once every process of it ended:
        143 when each trial it stopped committed its checkpoint at the step it stopped at, else 130. The
        study's MLflow run is marked KILLED with the line as its reason until a resume reopens it."""
        from ...components.core.tracking.client import mark_run_finished
        from ..local.interrupt import STOP_MARGIN_SECONDS, stop_descendants

        stopped = self.runner.stopped if self.runner is not None else []
        stop_descendants(self.config.train.preempt_grace_seconds + STOP_MARGIN_SECONDS)  # what is left, if any
        name = "Ctrl-C (SIGINT)" if stop.signum == 2 else "SIGTERM"
        if not self.name:
            return ExitCode.INTERRUPTED, f"relaunch: stopped by {name} before a study started"
        resume = f"`relaunch tune --resume --study {self.name}` continues it"
        if not stopped:
            line = f"relaunch: stopped by {name}; no trial was running; every process of the study ended; {resume}"
            code = ExitCode.INTERRUPTED
        else:
            steps, all_committed = [], True
            for record, context in stopped:
                summary = {}
                with contextlib.suppress(RelaunchError, OSError, ValueError):
                    summary = read_summary(context.store) or {}
                committed = summary.get("last_committed_step", -1)
                steps.append(f"trial {record.number} at step {committed}" if committed is not None and committed >= 0
                             else f"trial {record.number} before its first checkpoint")
                all_committed = all_committed and summary.get("exit_code") == ExitCode.PREEMPTED \
                    and committed == summary.get("last_step") and committed is not None and committed >= 0
            code = ExitCode.PREEMPTED if all_committed else ExitCode.INTERRUPTED
            line = (f"relaunch: stopped by {name}; trials stopped with their checkpoints ({', '.join(steps)}); "
                    f"every process of the study ended; {resume}")
        if self.study_config is not None and self.study_config.tracking.run_id:
            with contextlib.suppress(Exception):  # the line is printed whatever the server says
                mark_run_finished(self.study_config, self.study_config.tracking.run_id, "KILLED",
                                  f"interrupted: {line.removeprefix('relaunch: ')}")
        return code, line


def _state_dir(path: str) -> str:
    try:
        return expand_home(path)
    except ValueError as err:
        raise BadInput(f"--state-dir {err}") from None
