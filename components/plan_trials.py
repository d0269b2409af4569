"""Tuning step ``plan-trials``: open the study (create it in its Optuna storage) and say which of its
trials the pipeline fans out: every trial ``0 .. tune.trials-1`` that has not ended (a pipeline run again
continues the study: a complete, pruned or failed trial is not run again).

Each trial's parameters are asked by its own ``run-trial`` step when it begins (the study's sampler is
seeded per trial, so trial ``n`` gets the same parameters whoever asks and whenever; a trial that resumes
keeps those it recorded), so no Optuna trial is left open here for another process to close.

    python -m relaunch.components.plan_trials --config-json "$(cat study.json)" --input parent_run_id=RUN
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from .core.contract.config import RelaunchConfig
from .core.contract.errors import BadInput
from .core.tracking.client import call
from .core.tracking.context import Context
from .launchers.trial_job import study_storage


@dataclass
class PlanOutputs:
    trials: list
    """The fan-out's items, one per trial to run: ``{"trial": n, "config_json": the study's configuration,
    "parent_run_id": the study's MLflow run}`` (what each run-trial reads)."""


def run(config: RelaunchConfig, parent_run_id: str = "") -> PlanOutputs:
    """Open the study of ``config`` (prepared: its ``store.uri`` the study folder) and list its trials
    that have not ended, each with what its run-trial step reads.

    Raises:
        BadInput: an empty ``tune.space``, or an Optuna storage the trials' pods cannot share.
    """
    # optuna, by the tuning room's modules: only the tuning steps load it
    from .core.tuning.study_folder import StudyRecord, read_study, read_trial, write_study
    from .core.tuning.study import Study
    from .core.tuning.trials import STUDY_TAG, storage_for_records

    if not config.tune.space:
        raise BadInput("tune.space is empty: the tuning pipeline needs at least one field to search")
    storage = study_storage(config)
    study = Study(config, storage)
    context = Context(config)
    study_store = context.store
    if read_study(study_store) is None:
        write_study(study_store, StudyRecord(name=study.name, storage=storage_for_records(storage)))
    if parent_run_id:  # the study's MLflow run, the parent of its trials' runs, says which study it is
        call("tag the study's run", context.tracker.set_tag, parent_run_id, STUDY_TAG, study.name)
    trials = []
    for number in range(config.tune.trials):
        record = read_trial(study_store, number)
        if record is not None and record.final:
            print(f"plan-trials: trial {number} ended before ({record.state}); not run again", file=sys.stderr)
        else:
            trials.append({"trial": number, "config_json": config.to_json(), "parent_run_id": parent_run_id})
    return PlanOutputs(trials=trials)


if __name__ == "__main__":
    from .core.contract import steps
    from .core.runtime.stepcli import step_main

    sys.exit(step_main(steps.PLAN_TRIALS, run))
