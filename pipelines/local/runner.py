"""Run the KFP pipeline on this machine with ``kfp.local`` (SubprocessRunner, this Python environment):
the same definition as on a cluster, every step a subprocess. ``relaunch run`` calls :func:`run_pipeline`.

Output: one line per step (state, duration, what it found), the training's progress bar, then a
summary. kfp.local's own chatter and every step's log go to ``.relaunch/runs/<id>/pipeline.log``.

The fixes kfp.local needs are :mod:`relaunch.pipelines.local.kfp_fixes`; what is printed is :mod:`relaunch.pipelines.local.console`.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..spec import FINALIZE
from ...components.core.contract.config import RelaunchConfig
from ...components.core.contract.exitcodes import ExitCode
from ...components.core.store.records import attempt_key, read_json
from ...components.core.tracking.context import Context
from .interrupt import STOP_MARGIN_SECONDS, Interrupted, stop_descendants
from .console import STEPS, RunView, StepRecord, render_summary
from .kfp_fixes import install_local_fixes, use_warm_steps
from .warm_steps import WarmSteps, supported as warm_steps_supported

__all__ = ["STEPS", "RunResult", "StepRecord", "install_local_fixes", "render_summary", "run_pipeline"]


@dataclass
class RunResult:
    """How a local pipeline run ended, for the summary, the exit code, tests and the benchmark."""

    exit_code: int
    seconds: float
    steps: dict[str, StepRecord]
    run_dir: Path
    resumed: list[dict[str, Any]] = field(default_factory=list)
    failed_step: str | None = None

    @property
    def message(self) -> str:
        if self.failed_step is None:
            return ""
        rec = self.steps[self.failed_step]
        return rec.message or f"{self.failed_step} failed with exit code {rec.exit_code}"


def run_pipeline(config: RelaunchConfig, *, console=None, state_dir: str | Path = ".relaunch",
                 cold: bool = False, context: Context | None = None) -> RunResult:
    """Run the whole pipeline locally; returns when it ended (never raises for a failed step).

    Args:
        config: the validated configuration (``relaunch run`` checked it and its URIs first).
        console: a ``rich.console.Console`` for the step lines and the progress bar.
        state_dir: where kfp.local's outputs and this run's logs go.
        cold: every step, agent and worker a fresh interpreter (as on a cluster) instead of forks of
            the warm servers (:mod:`relaunch.pipelines.local.warm_steps`; always cold where they are not supported).
        context: ``config``'s context when the caller has one (``relaunch run``: its store opened for the lock).
    """
    context = context if context is not None else Context(config)
    run_dir = Path(state_dir) / "runs" / time.strftime("%Y%m%d-%H%M%S") / str(os.getpid())
    run_dir.mkdir(parents=True, exist_ok=True)
    # started first: its imports overlap ours and kfp.local's set-up
    warm_steps = None if cold or not warm_steps_supported() else WarmSteps(log_path=run_dir / "pipeline.log",
                                             extra_imports=(config.train.task.split(":")[0],))
    try:
        return _run_on_kfp_local(context, console, Path(state_dir), run_dir, warm_steps)
    finally:
        if warm_steps is not None:
            warm_steps.close()


def _run_on_kfp_local(context: Context, console, state_dir: Path, run_dir: Path, warm_steps) -> RunResult:
    from kfp import local
    from rich.console import Console

    from ..kfp_pipeline import build_pipeline

    config = context.config
    console = console or Console()
    console.file = console.file  # pin today's stdout: the pipeline's own output is redirected below
    events = run_dir / "events.jsonl"
    events.touch()
    install_local_fixes()
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(state_dir / "kfp-local"),
               raise_on_error=True)
    view = RunView(console, events, run_dir / "pipeline.log", committed_steps=_committed_steps(context))
    started = time.time()
    previous = os.environ.get("RELAUNCH_EVENTS")
    os.environ["RELAUNCH_EVENTS"] = str(events.resolve())
    use_warm_steps(warm_steps, run_dir / "pipeline.log")
    view.start()
    pipeline_error = ""
    try:
        with open(run_dir / "pipeline.log", "a", buffering=1) as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            build_pipeline(config)(config_json=config.to_json())
    except RuntimeError as err:  # kfp.local's "pipeline finished with status FAILURE"; the step said why
        pipeline_error = str(err)
    except Interrupted:  # the training commits its preemption checkpoint and ends before the view's last lines
        view.interrupted = True
        stop_descendants(config.train.preempt_grace_seconds + STOP_MARGIN_SECONDS,
                         spare=warm_steps.pids if warm_steps is not None else ())
        raise
    finally:
        use_warm_steps(None)
        if previous is None:
            os.environ.pop("RELAUNCH_EVENTS", None)
        else:
            os.environ["RELAUNCH_EVENTS"] = previous
        view.stop()
    failed = next((s for s in STEPS if view.steps[s].state == "failed"), None)
    if failed is None and pipeline_error:  # no step reported: kfp.local itself failed
        failed = FINALIZE.name
        view.steps[failed].state, view.steps[failed].exit_code = "failed", ExitCode.BUG
        view.steps[failed].message = f"{pipeline_error} (see {run_dir / 'pipeline.log'})"
    code = 0 if failed is None else int(view.steps[failed].exit_code or ExitCode.BUG)
    return RunResult(exit_code=code, seconds=time.time() - started, steps=view.steps, run_dir=run_dir,
                     resumed=view.resumed, failed_step=failed)


def _committed_steps(context: Context):
    """``attempt -> the steps it committed`` as the store's attempt record says (None when unreadable)."""
    def committed(attempt: int) -> set[int] | None:
        try:
            record = read_json(context.store, attempt_key(attempt))
        except Exception:  # noqa: BLE001 - the store is away: the view falls back to the attempt's summary
            return None
        if not isinstance(record, dict):
            return None
        steps = {int(step) for step in record.get("commits") or {}}
        last = int(record.get("last_committed_step", -1) if record.get("last_committed_step") is not None else -1)
        return steps | ({last} if last >= 0 else set())

    return committed
