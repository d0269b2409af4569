"""The pipeline's exit task (KFP ``dsl.ExitHandler``, Argo ``onExit``): close the MLflow run of this
pipeline run — FINISHED when the pipeline succeeded, FAILED with the reason when it did not — and
add what the pipeline did to the run's description (steps trained, restarts, evaluation, the
registered version). It only looks the run up (by the ``relaunch.pipeline_run_id`` tag); it never creates one.

It also writes what only the side that survives can: every attempt's tags, a last attempt SIGKILLed
with nothing after it included; and, when the pipeline succeeded, ``runs/pipeline-finished.json`` in
the store, which tells ``relaunch run --resume`` that nothing is left to do.

    python -m relaunch.components.finalize --config configs/local.yaml --input pipeline_run_id=ID --input state=FAILED
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from .core.contract.config import RelaunchConfig
from .core.contract.errors import RelaunchError
from .core.store.records import PIPELINE_FINISHED_KEY, write_pipeline_finished
from .core.tracking.client import find_pipeline_run, mark_run_finished
from .core.tracking.context import Context
from .core.tracking.lineage import describe_outcome, record_attempts
from .core.tracking.mlflow_tracker import deliver_pending_metrics


@dataclass
class FinalizeOutputs:
    run_id: str
    status: str


def run(config: RelaunchConfig, pipeline_run_id: str = "", state: str = "SUCCEEDED", error: str = "") -> FinalizeOutputs:
    """Mark the run FINISHED (``state`` SUCCEEDED) or FAILED; a no-op when no run was opened."""
    run_id = config.tracking.run_id or ""
    if not run_id and pipeline_run_id:
        run_id = find_pipeline_run(config, pipeline_run_id) or ""
    if not run_id:
        return FinalizeOutputs(run_id="", status="none")
    status = "FINISHED" if state == "SUCCEEDED" else "FAILED"
    context = Context(config)  # the store opened on first use: it may be away
    _deliver_pending_metrics(context, run_id)
    try:
        record_attempts(context, run_id)
    except (RelaunchError, OSError) as err:  # the store or the server is away: the run still gets its status
        print(f"finalize: attempt tags not written: {err}", file=sys.stderr)
    describe_outcome(context, run_id, status)
    mark_run_finished(config, run_id, status, "" if status == "FINISHED" else f"pipeline {state}: {error}".strip())
    if status == "FINISHED":
        try:
            write_pipeline_finished(context.store, run_id, pipeline_run_id)
        except (RelaunchError, OSError) as err:  # costs only a repeated evaluate/register on --resume
            print(f"finalize: {PIPELINE_FINISHED_KEY} not written: {err}", file=sys.stderr)
    return FinalizeOutputs(run_id=run_id, status=status)


def _deliver_pending_metrics(context: Context, run_id: str) -> None:
    """The metric points the training kept while the tracking server was away, sent now that it may be back."""
    try:
        store = context.store
    except (RelaunchError, OSError) as err:  # the store is away: they stay for the next --resume
        print(f"finalize: pending metric points not sent: {err}", file=sys.stderr)
        return
    deliver_pending_metrics(context.config, store, run_id, who="finalize")


if __name__ == "__main__":
    from .core.contract import steps
    from .core.runtime.stepcli import step_main

    sys.exit(step_main(steps.FINALIZE, run))
