"""The pipeline's exit task (KFP ``dsl.ExitHandler``, Argo ``onExit``): close the MLflow run of this
pipeline run — FINISHED when the pipeline succeeded, FAILED with the reason when it did not — and
add what the pipeline did to the run's description (steps trained, restarts, evaluation, the
registered version). It only looks the run up (by the ``relaunch.pipeline_run_id`` tag); it never creates one.

    python -m components.finalize --config configs/local.yaml --input pipeline_run_id=ID --input state=FAILED
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from components.core.config import RelaunchConfig


@dataclass
class FinalizeOutputs:
    run_id: str
    status: str


def run(config: RelaunchConfig, pipeline_run_id: str = "", state: str = "SUCCEEDED", error: str = "") -> FinalizeOutputs:
    """Mark the run FINISHED (``state`` SUCCEEDED) or FAILED; a no-op when no run was opened."""
    from components.core.lineage import describe_outcome
    from components.core.tracking import PIPELINE_RUN_TAG, _call, _client, mark_run_finished, tracking_uri

    run_id = config.tracking.run_id or ""
    if not run_id and pipeline_run_id:
        client = _client(tracking_uri(config))
        experiment = _call("look up the experiment", client.get_experiment_by_name, config.tracking.experiment)
        found = [] if experiment is None else _call(
            "search runs", client.search_runs, [experiment.experiment_id],
            filter_string=f"tags.`{PIPELINE_RUN_TAG}` = '{pipeline_run_id}'", max_results=1)
        run_id = found[0].info.run_id if found else ""
    if not run_id:
        return FinalizeOutputs(run_id="", status="none")
    status = "FINISHED" if state == "SUCCEEDED" else "FAILED"
    describe_outcome(config, run_id, status)
    mark_run_finished(config, run_id, status, "" if status == "FINISHED" else f"pipeline {state}: {error}".strip())
    return FinalizeOutputs(run_id=run_id, status=status)


if __name__ == "__main__":
    from components.core.stepcli import step_main

    sys.exit(step_main("finalize", run))
