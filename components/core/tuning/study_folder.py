"""Where a study lives in the store, and the records it keeps there. This module owns every key of a
study folder that is not a training's own (those are :mod:`relaunch.components.core.store.records`' and
:mod:`relaunch.components.core.checkpoint.layout`'s):

    <store.uri>/studies/<study>/                 the study: a training-like folder of its own, where
        runs/config.json                         prepare stores the study's configuration and
        runs/mlflow-run.json                     the study's MLflow run (the parent of the trials' runs),
        datasets/<version>/                      and the dataset every trial trains on
        study.json                               the study record (:class:`StudyRecord`)
        optuna.db                                the Optuna storage, when the store is a local folder
        trials/<n>/                              trial ``n``: a relaunch training (its ``store.uri``),
            trial.json                           its trial record (:class:`TrialRecord`),
            metrics.log                          its validation lines, when the store is a local folder
            checkpoints/ runs/ datasets/         and everything a training keeps

A store that is not a local folder (s3://, gs://, az://) keeps the study's local files (the sqlite
Optuna storage, the trials' ``metrics.log``) in ``<state dir>/studies/<study>/`` instead.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..store import join_uri, parse_store_uri
from ..store.records import read_json, write_json

STUDIES = "studies"
"""The folder under a store root that holds one folder per study."""
TRIALS = "trials"
STUDY_KEY = "study.json"
TRIAL_KEY = "trial.json"
OPTUNA_DB = "optuna.db"
METRICS_LOG = "metrics.log"

RUNNING, COMPLETE, PRUNED, FAILED = "running", "complete", "pruned", "failed"
FINAL_STATES = (COMPLETE, PRUNED, FAILED)
"""A trial in one of these states is never run again (a resumed study skips it)."""

def study_uri(root: str, study: str) -> str:
    """The store URI of study ``study`` under the store root ``root``."""
    return join_uri(root, f"{STUDIES}/{study}")


def trial_key(number: int, name: str = "") -> str:
    """The key of ``name`` in trial ``number``'s folder, relative to the study folder."""
    return f"{TRIALS}/{int(number)}/{name}" if name else f"{TRIALS}/{int(number)}"


def trial_uri(study_store_uri: str, number: int) -> str:
    """The store URI of trial ``number`` of the study at ``study_store_uri``: the trial's ``store.uri``."""
    return join_uri(study_store_uri, trial_key(number))


def study_names(root_store) -> list[str]:
    """The studies under the store root ``root_store``, oldest first (by their records' creation time;
    by name for a study without a record yet)."""
    names = [e.rstrip("/").rsplit("/", 1)[-1] for e in root_store.list(f"{STUDIES}/", recursive=False)
             if e.endswith("/")]

    def created(name: str) -> tuple[float, str]:
        record = read_json(root_store, f"{STUDIES}/{name}/{STUDY_KEY}") or {}
        return float(record.get("created") or 0.0), name

    return sorted(names, key=created)


def local_study_dir(root_uri: str, study: str, state_dir: str | Path) -> Path:
    """The local folder of the study's files that must be on this machine (the sqlite Optuna storage,
    the trials' metrics files): the study's folder itself when the store is a local folder, else
    ``<state_dir>/studies/<study>``."""
    scheme, location, _ = parse_store_uri(root_uri)
    if scheme == "file":
        return Path(location).absolute() / STUDIES / study
    return Path(state_dir).absolute() / STUDIES / study


def default_storage(local_dir: Path) -> str:
    """The Optuna storage URL of a study whose ``tune.storage`` is unset: a sqlite file in its local folder."""
    return f"sqlite:///{local_dir / OPTUNA_DB}"


def metrics_path(local_dir: Path, number: int) -> Path:
    """Where trial ``number``'s rank 0 appends its validation lines (``RELAUNCH_METRICS_FILE``)."""
    return local_dir / TRIALS / str(int(number)) / METRICS_LOG


@dataclass
class TrialRecord:
    """What the study knows of trial ``number``, kept in its folder (``trials/<n>/trial.json``) so that a
    resumed study finds it: written when the trial starts, at each of its retries, and when it ends."""

    number: int
    params: dict[str, Any]
    state: str = RUNNING
    optuna_numbers: list[int] = field(default_factory=list)
    """Each Optuna trial this trial ran as: one, plus one per resume of the study while it ran."""
    run_id: str = ""
    """The trial's MLflow run (a child of the study's), the same across its restarts and resumes."""
    value: float | None = None
    """The objective: the last reported value of ``tune.objective.metric`` (a complete trial); for a pruned
    one, its value that the pruner judged."""
    step: int | None = None
    """The step of ``value``; for a pruned trial, the step it was pruned at."""
    exit_code: int | None = None
    reason: str = ""
    retries: int = 0
    """Retries spent on retryable exits (``tune.trial_retries``); a resume of the study is not one."""
    started: float = field(default_factory=time.time)
    ended: float | None = None

    @property
    def final(self) -> bool:
        return self.state in FINAL_STATES


def read_trial(study_store, number: int) -> TrialRecord | None:
    """Trial ``number``'s record, or None before it started."""
    data = read_json(study_store, trial_key(number, TRIAL_KEY))
    if data is None:
        return None
    known = {f.name for f in dataclasses.fields(TrialRecord)}
    return TrialRecord(**{k: v for k, v in data.items() if k in known})


def write_trial(study_store, record: TrialRecord) -> None:
    write_json(study_store, trial_key(record.number, TRIAL_KEY), dataclasses.asdict(record), indent=2)


def trial_records(study_store, trials: int) -> list[TrialRecord | None]:
    """The records of trials ``0 .. trials-1`` (None for a trial not started)."""
    return [read_trial(study_store, n) for n in range(trials)]


@dataclass
class StudyRecord:
    """The study's own record (``study.json``): what it is and how it ended."""

    name: str
    storage: str
    """The default sqlite Optuna storage's URL, or ``tune.storage`` when the configuration names one
    (its URL, which may hold credentials, is in no record)."""
    created: float = field(default_factory=time.time)
    state: str = RUNNING  # running | finished
    best_trial: int | None = None
    best_value: float | None = None
    registered: str = ""
    """``model v3`` when the best trial's model was registered; why not otherwise."""


def read_study(study_store) -> StudyRecord | None:
    data = read_json(study_store, STUDY_KEY)
    if data is None:
        return None
    known = {f.name for f in dataclasses.fields(StudyRecord)}
    return StudyRecord(**{k: v for k, v in data.items() if k in known})


def write_study(study_store, record: StudyRecord) -> None:
    write_json(study_store, STUDY_KEY, dataclasses.asdict(record), indent=2)
