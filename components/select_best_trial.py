"""Tuning step ``select-best-trial``: once every trial ended, the study's best trial (the best value of
``tune.objective``, the lowest number among equals), read from the trials' records in the study folder (what
each ``run-trial`` wrote, whichever pod ran it), logged to the study's MLflow run (best trial and value,
counts, the objective and importance plots), and handed to evaluate and register as that trial's
configuration: its folder, its checkpoints, its MLflow run.

    python -m relaunch.components.select_best_trial --config-json "$(cat study.json)" --input parent_run_id=RUN
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from .core.contract.config import RelaunchConfig
from .core.contract.errors import RelaunchError
from .core.contract.exitcodes import ExitCode
from .core.tracking.context import Context
from .launchers.trial_job import study_storage


@dataclass
class SelectOutputs:
    config_json: str
    """The best trial's whole configuration (what evaluate and register read)."""
    trial: int
    value: float
    run_id: str
    """The best trial's MLflow run (the registered version links to it)."""
    found: bool
    """A trial completed: the gate of evaluate."""


class NoTrialCompleted(RelaunchError):
    """Every trial of the study failed: the pipeline fails with their exit code when they agree on one."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.exit_code = code


def run(config: RelaunchConfig, parent_run_id: str = "") -> SelectOutputs:
    """The best trial of the study of ``config`` (prepared: its ``store.uri`` the study folder).

    Raises:
        NoTrialCompleted: no trial completed (the line names each failed trial's reason).
    """
    # optuna, by the tuning room's modules: only the tuning steps load it
    from .core.tuning.study_folder import read_study, trial_records, write_study
    from .core.tuning.report import log_study
    from .core.tuning.study import Study
    from .core.tuning.trials import best_trial, trial_config

    study_store = Context(config).store
    records = trial_records(study_store, config.tune.trials)
    best = best_trial(records, config.tune.objective.direction)
    if parent_run_id:
        log_study(config, parent_run_id, records, best, Study(config, study_storage(config)).param_importances())
    record = read_study(study_store)
    if record is not None:
        record.state = "finished" if best is not None else "failed"
        record.best_trial, record.best_value = (best.number, best.value) if best is not None else (None, None)
        write_study(study_store, record)
    if best is None:
        failed = [r for r in records if r is not None and r.exit_code]
        codes = sorted({int(r.exit_code) for r in failed})
        why = "; ".join(f"trial {r.number}: {r.reason or r.state}" for r in records if r is not None)[:400]
        raise NoTrialCompleted(f"no trial of the study {config.study_name} completed ({why or 'none ran'})",
                               codes[0] if len(codes) == 1 else int(ExitCode.BUG))
    print(f"select-best-trial: trial {best.number}, {config.tune.objective.metric} {best.value:.6g}, params "
          f"{best.params}", file=sys.stderr)
    chosen = trial_config(config, best.number, best.params, study_store_uri=config.store.uri, run_id=best.run_id)
    return SelectOutputs(config_json=chosen.to_json(), trial=best.number, value=float(best.value), run_id=best.run_id,
                         found=True)


if __name__ == "__main__":
    from .core.contract import steps
    from .core.runtime.stepcli import step_main

    sys.exit(step_main(steps.SELECT_TRIAL, run))
