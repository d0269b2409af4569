"""A study's trials as relaunch trainings: the study's stored configuration and the rules of its resume,
each trial's configuration and folder (:func:`begin_trial`), its MLflow run (a child of the study's),
its objective and its end (:func:`end_trial`), the best trial (:func:`best_trial`).

Both ``relaunch tune`` (:mod:`relaunch.pipelines.tune`) and a cluster pipeline's trial steps drive a trial
the same way::

    study = Study(config, storage_url)
    started = begin_trial(study, config, study_store, n, parent_run_id=parent)   # new, or resumed
    ...launch step run(started.config), reporting validations with study.report(...)...
    end_trial(study, started, state=COMPLETE, value=..., exit_code=0)
    best = best_trial(trial_records(study_store, config.tune.trials), config.tune.objective.direction)
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from typing import Any

import optuna

from ..contract.config import RelaunchConfig, TuneConfig
from ..contract.suggestions import apply_suggestions
from ..contract.errors import BadInput, RelaunchError
from ..contract.exitcodes import ExitCode, is_retryable
from ..data.shards import copy_dataset
from ..store.records import (dotted, identity_changes, read_summary, refuse_resume_changes,
                             remember_run, write_training_config)
from ..tracking.client import PARENT_RUN_TAG, call, ensure_run, mark_run_finished, reopen_run, tracking_uri
from ..tracking.context import Context
from ..tracking.lineage import record_attempts
from .study_folder import (COMPLETE, FAILED, PRUNED, RUNNING, TrialRecord, read_trial,
                           trial_uri, write_trial)
from .study import Study

TUNE_IDENTITY: tuple[str, ...] = ("tune.space", "tune.objective", "tune.sampler", "tune.pruner")
"""The keys that say what a study is besides its trainings' :data:`~relaunch.components.core.store.records.TRAINING_IDENTITY`: a resumed study
refuses to change them (``tune.trials``, ``tune.parallel``, ``tune.trial_retries`` may change)."""

FROM_THE_COMMAND_LINE = ("store.uri", "tracking.run_id", "launch.inject_failure", "tune.storage")
"""Keys a resumed study never takes from its stored configuration: where the store is, the MLflow run
(the study's own, from its ``runs/mlflow-run.json``), a demo's injected failure, and the Optuna storage
URL (stored without its password)."""

STATE_TAG = "relaunch.trial_state"
"""The tag of a trial's MLflow run: running, complete, pruned or failed (true at the trial's end), or
interrupted (stopped with its study; a resume runs it again)."""
INTERRUPTED = "interrupted"
STUDY_TAG = "relaunch.study"
TRIAL_TAG = "relaunch.trial"
RUN_STATUS = {COMPLETE: "FINISHED", PRUNED: "KILLED", FAILED: "FAILED"}
"""The MLflow status of a trial's run at its end."""


def storage_for_records(url: str) -> str:
    """``url`` with its password masked (``postgresql://user:***@host/db``): what a stored configuration
    or an MLflow param may show."""
    import sqlalchemy.engine

    try:
        return sqlalchemy.engine.make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - not a database URL: the storage's own check names it
        return url


def study_configuration(config: RelaunchConfig, stored: dict[str, Any] | None, study: str) -> RelaunchConfig:
    """The configuration a resumed study continues with: the one it stored (``stored``; ``config`` when
    it stored none), with the keys the command line set explicitly where they do not change what the
    study is (:data:`TUNE_IDENTITY`, :data:`~relaunch.components.core.store.records.TRAINING_IDENTITY`), and :data:`FROM_THE_COMMAND_LINE`'s.

    Raises:
        BadInput: an explicit key of the identity differs from the stored one; the line names the key,
            both values and how to start a new study with it.
    """
    if stored is None:
        return config
    own = json.loads(RelaunchConfig.model_validate(stored).to_json())
    asked = config.model_dump(mode="json", exclude_unset=True)
    changes = []
    for key in TUNE_IDENTITY:
        new = dotted(asked, key)
        if new is not None and _normalised(key, dotted(own, key)) != _normalised(key, new):
            changes.append((key, dotted(own, key), new))
    changes += [c for c in identity_changes(own, asked) if c[0] != "data.version"]  # prepare resolves it
    refuse_resume_changes(changes, f"the study {study}", "a resumed study keeps its configuration: drop that value, "
                          "or start a new study with it (--study NEW-NAME)")
    merged = _merge(own, asked)
    for key in FROM_THE_COMMAND_LINE:
        section, name = key.split(".")
        merged[section][name] = getattr(getattr(config, section), name)
    if config.tune.storage is None and own["tune"].get("storage"):
        merged["tune"]["storage"] = own["tune"]["storage"]  # the stored URL, its password from the environment
    merged["tracking"]["run_id"] = None
    return RelaunchConfig.model_validate(merged)


def _normalised(key: str, value: Any) -> Any:
    """A tune section's value as the model writes it (defaults filled), so that an explicit value equal
    to the stored one is no change."""
    if value is None:
        return None
    field = key.split(".", 1)[1]
    return json.loads(TuneConfig.model_validate({field: value}).model_dump_json())[field]


def _merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for key, value in top.items():
        out[key] = _merge(base[key], value) if isinstance(value, dict) and isinstance(base.get(key), dict) else value
    return out


def trial_config(study_config: RelaunchConfig, number: int, params: dict[str, Any], *, study_store_uri: str,
                 run_id: str | None) -> RelaunchConfig:
    """Trial ``number``'s training: the study's configuration (prepared: its ``data.version`` set) with
    ``params`` applied, its ``store.uri`` the trial's folder, its MLflow run ``run_id``.

    Raises:
        BadInput: a value its field refuses.
    """
    config = apply_suggestions(study_config, params)
    if config.tune.storage:  # a training needs no Optuna storage, and its command line shows its configuration
        config.tune.storage = storage_for_records(config.tune.storage)
    config.store.uri = trial_uri(study_store_uri, number)
    config.tracking.run_id = run_id
    config.tracking.run_name = f"{study_config.study_name}-trial-{number}"
    return config


@dataclass
class StartedTrial:
    """A trial about to run: its record (written), its Optuna trial, its training's configuration."""

    record: TrialRecord
    trial: optuna.trial.Trial
    config: RelaunchConfig
    context: Context
    """The training's context: ``config``, its folder's store and its MLflow client, each opened once."""
    resumed: bool
    """The trial had run before in this folder (a study resumed after its process died, a retried step)."""
    stale: list[int] = dataclasses.field(default_factory=list)
    """The Optuna trials of earlier runs of it that were told FAIL now."""


def begin_trial(study: Study, study_config: RelaunchConfig, study_store, number: int, *,
                parent_run_id: str) -> StartedTrial:
    """Start trial ``number``: a new one (its parameters asked, its MLflow run opened under the study's
    ``parent_run_id``, its folder given the configuration and the dataset), or one that ran before and
    did not end (its own parameters, folder and MLflow run; its stale Optuna trial told FAIL). The
    record says ``running`` with the new Optuna number before this returns.

    Raises:
        RelaunchError: the trial already ended (complete, pruned or failed: it is never run again).
        BadInput: a suggested value its configuration field refuses.
    """
    record = read_trial(study_store, number)
    if record is not None and record.final:
        raise RelaunchError(f"trial {number} of study {study.name} already ended ({record.state}); it is not run again")
    stale: list[int] = []
    if record is None:
        trial, params = study.ask(number)
        record = TrialRecord(number=number, params=params)
    else:
        stale = study.fail_stale(record.optuna_numbers)
        trial, _ = study.ask(number, record.params)
    config = trial_config(study_config, number, record.params, study_store_uri=study_store.uri, run_id=record.run_id or None)
    if not record.run_id:
        record.run_id = open_trial_run(config, parent_run_id, study.name, number)
        config.tracking.run_id = record.run_id
    else:
        reopen_run(config, record.run_id)
    record.optuna_numbers.append(trial.number)
    record.state, record.ended = RUNNING, None
    context = Context(config)  # the trial's folder: another configuration, another store
    trial_store = context.store
    write_training_config(trial_store, json.loads(config.to_json()))
    remember_run(trial_store, record.run_id, tracking_uri=tracking_uri(config), experiment=config.tracking.experiment)
    if config.data.version:
        give_dataset(study_store, trial_store, config.data.version)
    write_trial(study_store, record)
    call("tag the trial's run", context.tracker.set_tag, record.run_id, STATE_TAG, RUNNING)
    return StartedTrial(record=record, trial=trial, config=config, context=context, resumed=bool(stale) or len(record.optuna_numbers) > 1,
                        stale=stale)


def open_trial_run(config: RelaunchConfig, parent_run_id: str, study: str, number: int) -> str:
    """The MLflow run of trial ``number``: nested under the study's run (``mlflow.parentRunId``), found
    again rather than made twice when an earlier start made it and died before recording it."""
    unnamed = config.model_copy(deep=True)
    unnamed.tracking.run_id = None
    return ensure_run(unnamed, pipeline_run_id=f"{parent_run_id}/trial-{number}",
                      tags={PARENT_RUN_TAG: parent_run_id, STUDY_TAG: study, TRIAL_TAG: str(number)})


def give_dataset(study_store, trial_store, version: str) -> None:
    """The prepared dataset ``version`` in the trial's folder, where its training and evaluation read it:
    read back from the study's folder (verified) and written under the same content address (a no-op
    write when the trial has it: a resumed trial)."""
    copy_dataset(study_store, trial_store, version)


def objective(context: Context, reported: dict[int, dict[str, float]]) -> tuple[float, int] | None:
    """``(value, step)`` of the study's objective for the trial of ``context`` (its training's): the last
    reported value of ``tune.objective.metric`` (its final model's; the training summary's final metrics
    when they hold it, else the last validation line); None when there is none."""
    metric = context.config.tune.objective.metric
    summary = read_summary(context.store) or {}
    final = (summary.get("final_metrics") or {}).get(metric)
    if isinstance(final, (int, float)) and summary.get("last_step", -1) >= 0:
        return float(final), int(summary["last_step"])
    steps = [s for s in sorted(reported) if metric in reported[s]]
    return (reported[steps[-1]][metric], steps[-1]) if steps else None


def end_trial(study: Study, started: StartedTrial, study_store, *, state: str, value: float | None = None,
              step: int | None = None, exit_code: int | None = None, reason: str = "") -> TrialRecord:
    """Tell Optuna and write the record: trial ``started`` ended ``state`` (complete with ``value`` at
    ``step``, pruned at ``step``, failed with ``exit_code`` and ``reason``); its MLflow run gets its
    attempts' tags, the state tag and the status of :data:`RUN_STATUS`."""
    record = started.record
    if state == COMPLETE:
        study.complete(started.trial.number, float(value))
    elif state == PRUNED:
        study.prune(started.trial.number)
    else:
        study.fail(started.trial.number)
    record.state, record.value, record.step = state, value, step
    record.exit_code, record.reason, record.ended = exit_code, reason, time.time()
    write_trial(study_store, record)
    close_trial_run(started.context, record)
    return record


def close_trial_run(context: Context, record: TrialRecord) -> None:
    """The trial's MLflow run as its end says: attempts' tags, state tag, objective, status."""
    config, client = context.config, context.tracker
    try:
        record_attempts(context, record.run_id)
    except (RelaunchError, OSError):  # the store is away: the state and status still go out
        pass
    call("tag the trial's run", client.set_tag, record.run_id, STATE_TAG, record.state)
    if record.state == COMPLETE and record.value is not None:
        call("log the objective", client.log_metric, record.run_id, f"objective_{config.tune.objective.metric}",
             record.value, step=record.step or 0)
    why = "" if record.state == COMPLETE else (f"trial {record.state}" + (f": {record.reason}" if record.reason else ""))
    mark_run_finished(config, record.run_id, RUN_STATUS[record.state], why)


def interrupted_trial_run(context: Context, record: TrialRecord) -> None:
    """The MLflow run of a trial stopped with its study: state ``interrupted`` and status KILLED (nothing
    trains into it any more) until a resume reopens it (:func:`begin_trial`). The training's own KILLED
    is not enough: its logger gets a few seconds after the checkpoint and may not deliver it, and a
    trial killed after the grace says nothing."""
    call("tag the trial's run", context.tracker.set_tag, record.run_id, STATE_TAG, INTERRUPTED)
    mark_run_finished(context.config, record.run_id, "KILLED", "trial interrupted: its study was stopped; a resume runs it again")


def best_trial(records: list[TrialRecord | None], direction: str) -> TrialRecord | None:
    """The complete trial with the best value (the lowest trial number among equals), or None."""
    complete = [r for r in records if r is not None and r.state == COMPLETE and r.value is not None]
    if not complete:
        return None
    sign = 1.0 if direction == "minimize" else -1.0
    return min(complete, key=lambda r: (sign * float(r.value), r.number))


def retryable_end(exit_code: int) -> bool:
    """Whether a trial that ended with ``exit_code`` is retried (from its own checkpoints): the contract's
    retryable codes (a kill, a preemption, a transient failure); never a user error."""
    return exit_code != ExitCode.OK and is_retryable(exit_code)


def check_objective_metric(config: RelaunchConfig, metrics: dict[str, float]) -> None:
    """Refuse a ``tune.objective.metric`` that the trial's validation does not give.

    Raises:
        BadInput: one line naming the metric and the ones there are.
    """
    metric = config.tune.objective.metric
    if metric not in metrics:
        raise BadInput(f"tune.objective.metric: {metric!r} is not a validation metric of the task (it gives "
                       f"{', '.join(sorted(metrics))}); set it to one of those")


def check_validation_metric(config: RelaunchConfig) -> None:
    """Refuse, before anything is written, a ``train.task_options.<name>`` in the search space that the
    task does not read, and a ``tune.objective.metric`` the task's validation does not give: the task's
    metrics of a freshly built model on the first samples of its validation split, named as the
    trainer names them (``val_<name>``).

    Raises:
        BadInput: one line naming the metric and the ones there are.
    """
    from ..data import preview_split
    from ...tasks.base import check_task_options, load_task

    task = load_task(config.train.task, config)
    searched = {key.split(".", 2)[2]: None for key in config.tune.space if key.startswith("train.task_options.")}
    check_task_options(task, searched, config.train.task, what="tune.space: train.task_options")
    split = preview_split(task, "val")
    check_objective_metric(config, {f"val_{k}": v for k, v in task.evaluate(task.build_model(), split).items()})
