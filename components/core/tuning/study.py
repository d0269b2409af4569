"""The Optuna side of a study: its storage, a sampler seeded per trial, the pruner, asking for a trial's
parameters (new, or those of a trial that resumes), reporting intermediate values, telling the end.

Optuna does not persist a sampler's random state, so a study that resumed after its process died would
suggest other parameters than an uninterrupted one. Here every trial is asked with a sampler of its
own, seeded from ``(tune.sampler.seed, trial number)`` (:func:`trial_seed`): trial ``n`` gets the same
parameters whenever it is asked, while the sampler draws at random (TPE's first ``n_startup_trials``,
10, and the random sampler always). Past those, TPE reads the trials that completed when it is asked;
with ``tune.parallel`` > 1 that set depends on which finished first, as in any parallel Optuna study.

A trial that was running when its study's process died is resumed as a new Optuna trial with the same
parameters (Optuna cannot adopt a RUNNING trial of a dead process through its public API): the stale
one is told FAIL, the parameters are enqueued with the relaunch trial number as a user attribute
(:data:`TRIAL_ATTR`), and the next ask returns them. The relaunch trial (its folder, checkpoints and
MLflow run) stays the same; only its Optuna number changes, and its record lists every one.

Optuna is a dependency of relaunch (``optuna`` in pyproject.toml); it is imported at the top here
because only the tuning commands and steps import this module.
"""

from __future__ import annotations

import hashlib
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState

from ..contract.config import RelaunchConfig, TuneParameter
from ..contract.errors import BadInput, RelaunchError

TRIAL_ATTR = "relaunch_trial"
"""The user attribute of an Optuna trial naming the relaunch trial (its folder ``trials/<n>/``) it runs."""


def trial_seed(seed: int, number: int) -> int:
    """The sampler seed of trial ``number`` of a study seeded ``seed``: a 32-bit hash of both, so that
    neighbouring trials and studies draw unrelated streams."""
    digest = hashlib.sha256(f"relaunch-tune:{int(seed)}:{int(number)}".encode()).digest()
    return int.from_bytes(digest[:4], "big")


def make_sampler(config: RelaunchConfig, number: int) -> optuna.samplers.BaseSampler:
    """The sampler that asks trial ``number``'s parameters (``tune.sampler``, seeded by :func:`trial_seed`)."""
    sampler = config.tune.sampler
    seed = trial_seed(sampler.seed, number)
    if sampler.name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed)


def make_pruner(config: RelaunchConfig) -> optuna.pruners.BasePruner:
    """``tune.pruner``: the median rule after ``startup_trials`` complete trials and ``warmup_steps``, or none."""
    pruner = config.tune.pruner
    if pruner.name == "none":
        return optuna.pruners.NopPruner()
    return optuna.pruners.MedianPruner(n_startup_trials=pruner.startup_trials, n_warmup_steps=pruner.warmup_steps)


def suggest(trial: optuna.trial.Trial, space: dict[str, TuneParameter]) -> dict[str, Any]:
    """Trial ``trial``'s value of every key of ``space`` (in key order: the sampler's draws are the same
    whatever order the YAML gave); an enqueued trial returns its fixed values."""
    values: dict[str, Any] = {}
    for path in sorted(space):
        p = space[path]
        if p.type == "categorical":
            values[path] = trial.suggest_categorical(path, p.choices)
        elif p.type == "int":
            values[path] = trial.suggest_int(path, int(p.low), int(p.high), step=int(p.step or 1), log=p.log)
        elif p.type == "log_uniform":
            values[path] = trial.suggest_float(path, p.low, p.high, log=True)
        else:
            values[path] = trial.suggest_float(path, p.low, p.high, step=p.step)
    return values


def open_storage(url: str) -> optuna.storages.BaseStorage:
    """The Optuna storage at ``url`` (a sqlite file's folder is created).

    Raises:
        BadInput: it cannot be opened (unreachable database, refused credentials, not a database URL);
            the line names ``tune.storage`` and the first line of the cause.
    """
    import sqlalchemy.exc

    if url.startswith("sqlite:///"):
        Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    try:
        return optuna.storages.RDBStorage(url, engine_kwargs=_engine_options(url))
    except (sqlalchemy.exc.SQLAlchemyError, ValueError, ImportError) as err:
        first = (str(err).splitlines() or [type(err).__name__])[0][:200]
        raise BadInput(f"tune.storage: cannot open the Optuna storage ({first})") from None


def _engine_options(url: str) -> dict[str, Any]:
    if url.startswith("sqlite"):
        return {"connect_args": {"timeout": 30}}  # a reader of the same file (a dashboard) waits, not fails
    if url.startswith("postgresql"):
        return {"connect_args": {"connect_timeout": 10}, "pool_pre_ping": True}
    return {}


@dataclass
class PruneVerdict:
    """Why a trial is pruned: its best value so far at ``step`` is worse than the median of the complete
    trials at that step (what Optuna's median rule compares)."""

    step: int
    value: float
    median: float | None

    def describe(self, metric: str, direction: str) -> str:
        """``val_loss 0.61 > median 0.42``."""
        if self.median is None:
            return f"{metric} {self.value:.4g}"
        sign = ">" if direction == "minimize" else "<"
        return f"{metric} {self.value:.4g} {sign} median {self.median:.4g}"


class Study:
    """One Optuna study of relaunch trainings, named ``config.study_name``, in the storage at ``storage_url``.

    Args:
        config: the study's configuration (its ``tune`` section says the space, objective, sampler, pruner).
        storage_url: the Optuna storage (``tune.storage``, else :func:`~relaunch.components.core.tuning.study_folder.default_storage`).

    Raises:
        BadInput: the storage cannot be opened.
    """

    def __init__(self, config: RelaunchConfig, storage_url: str):
        self.config, self.name = config, config.study_name
        self.metric, self.direction = config.tune.objective.metric, config.tune.objective.direction
        optuna.logging.set_verbosity(optuna.logging.WARNING)  # its INFO lines ("Trial 3 finished ...") are ours to say
        self.storage = open_storage(storage_url)
        self.study = optuna.create_study(storage=self.storage, study_name=self.name, direction=self.direction,
                                         load_if_exists=True, pruner=make_pruner(config))

    def ask(self, number: int, params: dict[str, Any] | None = None) -> tuple[optuna.trial.Trial, dict[str, Any]]:
        """A new Optuna trial for relaunch trial ``number`` and its parameters: drawn by the trial's own
        sampler, or ``params`` (a trial that resumes: enqueued, then asked).

        Raises:
            RelaunchError: the storage handed out a trial enqueued for another relaunch trial.
        """
        study = optuna.load_study(study_name=self.name, storage=self.storage, sampler=make_sampler(self.config, number),
                                  pruner=make_pruner(self.config))
        if params is not None and not self._waiting(number):  # a crash may have left it enqueued
            study.enqueue_trial(params, user_attrs={TRIAL_ATTR: number})
        trial = study.ask()
        owner = trial.user_attrs.get(TRIAL_ATTR)
        if owner is None:
            trial.set_user_attr(TRIAL_ATTR, number)
        elif owner != number:
            raise RelaunchError(f"the Optuna storage of study {self.name} handed trial {number} the parameters "
                                f"enqueued for trial {owner}")
        return trial, suggest(trial, self.config.tune.space)

    def _waiting(self, number: int) -> bool:
        return any(t.user_attrs.get(TRIAL_ATTR) == number
                   for t in self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,)))

    def fail_stale(self, optuna_numbers: list[int]) -> list[int]:
        """Tell FAIL each of ``optuna_numbers`` still RUNNING (its process is gone); the ones told."""
        stale = [t.number for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
                 if t.number in set(optuna_numbers)]
        for n in stale:
            self.study.tell(n, state=TrialState.FAIL, skip_if_finished=True)
        return stale

    def report(self, trial: optuna.trial.Trial, step: int, value: float) -> PruneVerdict | None:
        """Report ``value`` of the objective metric at ``step``; a verdict when the pruner stops the trial."""
        trial.report(float(value), int(step))
        if not trial.should_prune():
            return None
        return PruneVerdict(step=int(step), value=self._best_so_far(trial, step, value), median=self.median_at(step))

    def _best_so_far(self, trial: optuna.trial.Trial, step: int, value: float) -> float:
        frozen = next((t for t in self.study.get_trials(deepcopy=False) if t.number == trial.number), None)
        values = [v for s, v in (frozen.intermediate_values.items() if frozen else []) if s <= step and not math.isnan(v)]
        values = values or [float(value)]
        return min(values) if self.direction == "minimize" else max(values)

    def median_at(self, step: int) -> float | None:
        """The median of the complete trials' values at ``step`` (None when none has one)."""
        values = [t.intermediate_values[step] for t in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                  if step in t.intermediate_values and not math.isnan(t.intermediate_values[step])]
        return statistics.median(values) if values else None

    def complete(self, optuna_number: int, value: float) -> None:
        self.study.tell(optuna_number, float(value), skip_if_finished=True)

    def prune(self, optuna_number: int) -> None:
        self.study.tell(optuna_number, state=TrialState.PRUNED, skip_if_finished=True)

    def fail(self, optuna_number: int) -> None:
        self.study.tell(optuna_number, state=TrialState.FAIL, skip_if_finished=True)

    def param_importances(self) -> dict[str, float]:
        """Each parameter's share of the objective's variance over the complete trials (fANOVA, seeded);
        {} with fewer than two complete trials or a single parameter value."""
        complete = self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        if len(complete) < 2:
            return {}
        evaluator = optuna.importance.FanovaImportanceEvaluator(seed=self.config.tune.sampler.seed)
        try:
            return optuna.importance.get_param_importances(self.study, evaluator=evaluator)
        except (RuntimeError, ValueError):  # every complete trial drew the same value of every parameter
            return {}
