"""Tuning step ``run-trial``: one trial of the study, fanned out once per trial (KFP ``ParallelFor``, Argo
``withParam``): a relaunch training in the trial's own folder ``studies/<study>/trials/<n>/`` with its own
MLflow run (a child of the study's), launched by ``launch.backend`` as the launch step launches a training.

The trial's retries are this step's own loop: KFP does not honour ``set_retry`` on a task inside a
``ParallelFor`` (kubeflow/pipelines#12389, #13897), so a training that ends with a retryable code of the
contract (a kill, a preemption, a transient failure) is launched again here, up to ``tune.trial_retries``
times, and resumes from the trial's last checkpoint (the trainer always does). On Argo the fanned-out
template's ``retryStrategy`` also retries this step when its own pod dies; the step run again finds the
trial ``running`` and continues it (same folder, parameters and MLflow run), and a trial that ended
is never run again. A trial that fails for good ends ``failed`` and the step succeeds: one failed trial
fails itself, not the study.

    python -m relaunch.components.run_trial --config-json "$(cat study.json)" --input trial=0 \\
        --input parent_run_id=RUN --input pipeline_run_id=manual
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from .core.contract.config import RelaunchConfig
from .core.contract.exitcodes import ExitCode
from .core.store.records import read_summary
from .core.store.ledger import completed
from .core.tracking.context import Context
from .launchers import backend_module
from .launchers.trial_job import study_storage


@dataclass
class TrialOutputs:
    number: int
    state: str
    """complete, or failed (a pruned trial needs validations reported while it runs: only ``relaunch tune``)."""
    value: str
    """The objective (``tune.objective.metric`` of the trial's final model) as text; empty unless complete."""
    run_id: str
    """The trial's MLflow run."""
    retries: int
    """Launches of the trial after the first (its checkpoints made each one a resume)."""


def run(config: RelaunchConfig, trial: int | str = 0, parent_run_id: str = "", pipeline_run_id: str = "") -> TrialOutputs:
    """Run trial ``trial`` of the study of ``config`` (prepared: its ``store.uri`` the study folder) to its end.

    Raises:
        BadInput: a suggested value its configuration field refuses, an Optuna storage the pods cannot share.
        TransientFailure: the store, the tracking server or the Optuna storage away (the step is retried).
    """
    # optuna, by the tuning room's modules: only the tuning steps load it
    from .core.tuning.study_folder import COMPLETE, FAILED, read_trial, write_trial
    from .core.tuning.study import Study
    from .core.tuning.trials import begin_trial, end_trial, objective, retryable_end

    number, tune = int(trial), config.tune
    study_store = Context(config).store  # the study's folder; the trial's own context comes with begin_trial
    record = read_trial(study_store, number)
    if record is not None and record.final:
        print(f"run-trial: trial {number} ended before ({record.state}); not run again", file=sys.stderr)
        return _outputs(record)
    study = Study(config, study_storage(config))
    started = begin_trial(study, config, study_store, number, parent_run_id=parent_run_id)
    record = started.record
    if started.resumed:
        print(f"run-trial: trial {number} resumes in {started.config.store.uri}", file=sys.stderr)
    while True:
        result = backend_module(started.config).launch(
            started.config, pipeline_run_id=f"{pipeline_run_id or study.name}-trial-{number}", resume_from=None)
        code = result.exit_code
        if code == ExitCode.OK or not retryable_end(code) or record.retries >= tune.trial_retries:
            break
        record.retries += 1
        write_trial(study_store, record)
        print(f"run-trial: trial {number} ended with exit code {code}; launched again (retry {record.retries} of "
              f"{tune.trial_retries}), it resumes from its last checkpoint", file=sys.stderr)
    summary = read_summary(started.context.store) or {}
    found = objective(started.context, {}) if code == ExitCode.OK and completed(summary) else None
    if found is not None:
        value, step = found
        record = end_trial(study, started, study_store, state=COMPLETE, value=value, step=step, exit_code=0)
    else:
        reason = (result.message or f"the training ended with exit code {code}") if code != ExitCode.OK else (
            f"the training ended at step {summary.get('last_step')} of {summary.get('total_steps')} without "
            f"{tune.objective.metric}")
        if code != ExitCode.OK and retryable_end(code):
            reason = f"{reason} (its {tune.trial_retries} retries spent)"
        record = end_trial(study, started, study_store, state=FAILED, exit_code=code, reason=reason[:300])
        print(f"run-trial: trial {number} failed: {record.reason}", file=sys.stderr)
    return _outputs(record)


def _outputs(record) -> TrialOutputs:
    return TrialOutputs(number=record.number, state=record.state,
                        value=repr(float(record.value)) if record.value is not None else "",
                        run_id=record.run_id, retries=record.retries)


if __name__ == "__main__":
    from .core.contract import steps
    from .core.runtime.stepcli import step_main

    sys.exit(step_main(steps.RUN_TRIAL, run))
