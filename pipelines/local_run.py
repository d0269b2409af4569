"""Run the KFP pipeline on this machine with ``kfp.local`` (SubprocessRunner, this Python environment):
the same definition as on a cluster, every step a subprocess. ``relaunch run`` calls :func:`run_pipeline`.

Output: one line per step (state, duration, what it found), the training's progress bar, then a
summary. kfp.local's own chatter and every step's log go to ``.relaunch/runs/<id>/pipeline.log``.

What kfp.local 2.17 does not carry, and the two small fixes :func:`install_local_fixes` applies:

1. ``dsl.If`` on a task output inside a nested DAG (our ExitHandler): its condition evaluator only
   resolves channels named ``<task>-Output`` or ``<task>--<key>``, so ``evaluate-passed`` resolves
   to nothing and the branch is silently skipped. The fix also resolves ``<task>-<key>``.
2. Retries ignore exit codes (as KFP v2 does everywhere): a permanent failure (bad input, exit 2)
   would be retried with backoff. The fix keeps the task's own retry policy and backoff but stops
   at once on a code that :func:`components.core.exitcodes.is_retryable` refuses.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from components import STEP_TABLE
from components.core.config import RelaunchConfig
from components.core.exitcodes import MEANING, ExitCode, is_retryable, normalize

STEPS = tuple(STEP_TABLE)  # the five steps and the exit task
_last_code = threading.local()


def install_local_fixes() -> None:
    """Patch kfp.local's condition resolver and retry loop (see the module docstring); idempotent."""
    from kfp.local import subprocess_task_handler as sth
    from kfp.local.orchestrator import enhanced_dag_orchestrator as edo
    from kfp.local.orchestrator import task_executor

    if getattr(task_executor, "_relaunch_fixed", False):
        return
    run_subprocess, execute = sth.run_local_subprocess, task_executor.execute_single_task
    resolve = edo.ConditionEvaluator._resolve_pipeline_channel

    def recording_subprocess(full_command, env_vars=None):
        _last_code.value = run_subprocess(full_command, env_vars)
        return _last_code.value

    def resolve_channel(channel_ref: str, io_store):
        ref = channel_ref.removeprefix("pipelinechannel--")
        for i in (i for i, ch in enumerate(ref) if ch == "-"):
            with contextlib.suppress(ValueError):
                return io_store.get_task_output(ref[:i], ref[i + 1:])
        return resolve(channel_ref, io_store)

    def execute_by_exit_code(task_name, task_spec, **kwargs):
        policy = task_spec.retry_policy
        once = type(task_spec)()
        once.CopyFrom(task_spec)
        once.ClearField("retry_policy")
        for attempt in range(policy.max_retry_count + 1):
            _last_code.value = None
            outputs, status = execute(task_name=task_name, task_spec=once, **kwargs)
            code = ExitCode.OK if status.name == "SUCCESS" else normalize(_last_code.value or ExitCode.BUG)
            _emit("attempt-end", step=task_name, exit_code=code)
            if code == ExitCode.OK or attempt >= policy.max_retry_count or not is_retryable(code):
                return outputs, status
            delay = min(policy.backoff_duration.seconds * (policy.backoff_factor or 2.0) ** attempt,
                        policy.backoff_max_duration.seconds or 3600)
            _emit("retry", step=task_name, attempt=attempt + 1, limit=policy.max_retry_count, exit_code=code, delay=delay)
            time.sleep(delay)
        return outputs, status

    sth.run_local_subprocess = recording_subprocess
    edo.ConditionEvaluator._resolve_pipeline_channel = staticmethod(resolve_channel)
    task_executor.execute_single_task = execute_by_exit_code
    task_executor._relaunch_fixed = True


def _emit(kind: str, **payload: Any) -> None:
    path = os.environ.get("RELAUNCH_EVENTS")
    if path:
        with open(path, "a") as fh:
            fh.write(json.dumps({"kind": kind, "time": time.time(), **payload}, default=str) + "\n")


@dataclass
class StepRecord:
    """What the events said about one step."""

    state: str = "pending"  # pending | running | succeeded | failed | skipped
    attempts: int = 0
    started: float = 0.0
    seconds: float = 0.0
    exit_code: int | None = None
    message: str = ""
    outputs: dict[str, Any] = field(default_factory=dict)


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


def run_pipeline(config: RelaunchConfig, *, console=None, state_dir: str | Path = ".relaunch") -> RunResult:
    """Run the whole pipeline locally; returns when it ended (never raises for a failed step).

    Args:
        config: the validated configuration (``relaunch run`` checked it and its URIs first).
        console: a ``rich.console.Console`` for the step lines and the progress bar.
        state_dir: where kfp.local's outputs and this run's logs go.
    """
    from kfp import local
    from rich.console import Console

    from pipelines.kfp_pipeline import build_pipeline

    console = console or Console()
    console.file = console.file  # pin today's stdout: the pipeline's own output is redirected below
    run_dir = Path(state_dir) / "runs" / time.strftime("%Y%m%d-%H%M%S") / str(os.getpid())
    run_dir.mkdir(parents=True, exist_ok=True)
    events = run_dir / "events.jsonl"
    events.touch()
    install_local_fixes()
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(Path(state_dir) / "kfp-local"),
               raise_on_error=True)
    view = _View(console, events, run_dir / "pipeline.log")
    started = time.time()
    previous = os.environ.get("RELAUNCH_EVENTS")
    os.environ["RELAUNCH_EVENTS"] = str(events.resolve())
    view.start()
    pipeline_error = ""
    try:
        with open(run_dir / "pipeline.log", "a", buffering=1) as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            build_pipeline(config)(config_json=config.to_json())
    except RuntimeError as err:  # kfp.local's "pipeline finished with status FAILURE"; the step said why
        pipeline_error = str(err)
    finally:
        if previous is None:
            os.environ.pop("RELAUNCH_EVENTS", None)
        else:
            os.environ["RELAUNCH_EVENTS"] = previous
        view.stop()
    failed = next((s for s in STEPS if view.steps[s].state == "failed"), None)
    if failed is None and pipeline_error:  # no step reported: kfp.local itself failed
        failed = "finalize"
        view.steps[failed].state, view.steps[failed].exit_code = "failed", ExitCode.BUG
        view.steps[failed].message = f"{pipeline_error} (see {run_dir / 'pipeline.log'})"
    code = 0 if failed is None else int(view.steps[failed].exit_code or ExitCode.BUG)
    return RunResult(exit_code=code, seconds=time.time() - started, steps=view.steps, run_dir=run_dir,
                     resumed=view.resumed, failed_step=failed)


class _View:
    """Tails the event file: prints a line per step and draws the training's progress bar."""

    def __init__(self, console, events: Path, log: Path):
        self.console, self.events, self.log = console, events, log
        self.steps = {s: StepRecord() for s in STEPS}
        self.resumed: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="relaunch-run-view")
        self._progress = None
        self._bar = None
        self._offset = 0

    def start(self) -> None:
        self.console.print(f"[bold]relaunch run[/] — steps run by kfp.local; full log: {self.log}", soft_wrap=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self._drain()
        self._end_bar()

    def _loop(self) -> None:
        while not self._stop.wait(0.2):
            self._drain()

    def _drain(self) -> None:
        with open(self.events) as fh:
            fh.seek(self._offset)
            while True:
                line = fh.readline()
                if not line.endswith("\n"):
                    break
                self._offset = fh.tell()
                with contextlib.suppress(ValueError):
                    self._handle(json.loads(line))

    def _print(self, text: str) -> None:
        (self._progress.console if self._progress else self.console).print(text, highlight=False, soft_wrap=True)

    def _handle(self, ev: dict[str, Any]) -> None:
        kind, step = ev.get("kind"), ev.get("step")
        if kind == "step-start" and step in self.steps:
            rec = self.steps[step]
            rec.state, rec.attempts, rec.started = "running", rec.attempts + 1, ev["time"]
        elif kind == "step-end" and step in self.steps:
            self._step_end(self.steps[step], step, ev)
        elif kind == "attempt-end" and step in self.steps and ev["exit_code"] and self.steps[step].state == "running":
            rec = self.steps[step]  # the step's process ended without reporting: killed, or kfp.local failed it
            rec.state, rec.exit_code, rec.seconds = "failed", ev["exit_code"], ev["time"] - rec.started
            rec.message = f"its process ended without a report ({MEANING.get(ev['exit_code'], 'unknown code')})"
            self._print(f"  [red]✗[/] {step:<26} {rec.seconds:6.1f}s  exit {rec.exit_code}: {rec.message}")
        elif kind == "retry":
            code = ev["exit_code"]
            self._print(f"  [yellow]↻[/] {ev['step']:<26} retry {ev['attempt']}/{ev['limit']} in {ev['delay']:.0f}s "
                        f"(exit {code}: {MEANING.get(code, 'unknown')})")
        elif kind == "resumed":
            self.resumed.append(ev)
            where = f"resumed from step {ev['step']}" if int(ev.get("step", -1)) >= 0 else "started from scratch"
            self._print(f"    [cyan]↳[/] training attempt {ev.get('attempt', '?')} {where}")
        elif kind == "progress":
            self._progress_update(ev)

    def _step_end(self, rec: StepRecord, step: str, ev: dict[str, Any]) -> None:
        rec.seconds = ev["time"] - rec.started
        rec.exit_code, rec.message, rec.outputs = ev.get("exit_code", 0), ev.get("message", ""), ev.get("outputs", {})
        rec.state = "succeeded" if rec.exit_code == 0 else "failed"
        if step == "launch":
            self._end_bar()
        mark = "[green]✓[/]" if rec.exit_code == 0 else "[red]✗[/]"
        detail = _detail(step, rec) if rec.exit_code == 0 else f"exit {rec.exit_code}: {rec.message}"
        self._print(f"  {mark} {step:<26} {rec.seconds:6.1f}s  {detail}")
        if step == "evaluate" and rec.exit_code == 0 and not rec.outputs.get("passed"):
            self.steps["register"].state = "skipped"
            self._print(f"  [yellow]–[/] {'register':<26} {'':>7}  skipped: the evaluation gate failed")

    def _progress_update(self, ev: dict[str, Any]) -> None:
        total, step = int(ev.get("total_steps") or 0), int(ev.get("step", 0))
        if not self.console.is_terminal or not total:
            return
        if self._progress is None:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(TextColumn("    training"), BarColumn(), MofNCompleteColumn(),
                                      TextColumn("{task.fields[info]}"), TimeElapsedColumn(),
                                      console=self.console, transient=True, redirect_stdout=False, redirect_stderr=False)
            self._progress.start()
            self._bar = self._progress.add_task("train", total=total, info="")
        info = f"loss {ev['loss']:.4f}" if isinstance(ev.get("loss"), (int, float)) else ""
        self._progress.update(self._bar, completed=step, total=total, info=info)

    def _end_bar(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def _detail(step: str, rec: StepRecord) -> str:
    o = rec.outputs
    if step == "prepare":
        return f"dataset {o.get('dataset_version')}, MLflow run {o.get('run_id')}"
    if step == "locate-latest-checkpoint":
        return f"{o.get('source')}: step {o.get('step')}" if o.get("checkpoint_uri") else "no checkpoint: fresh start"
    if step == "launch":
        return (f"{o.get('train_seconds', 0):.1f}s training, {o.get('restarts', 0)} restart(s), "
                f"ETTR {o.get('ettr', 0):.3f}")
    if step == "evaluate":
        return f"{_metrics(o.get('metrics_json'))} at step {o.get('step')}, gate {'passed' if o.get('passed') else 'failed'}"
    if step == "register":
        return f"{o.get('model_name')} v{o.get('version')} {o.get('aliases')}"
    if step == "finalize":
        return f"MLflow run {o.get('status')}"
    return ""


def _metrics(text: str | None) -> str:
    try:
        values = json.loads(text or "{}")
    except ValueError:
        return str(text)
    return ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in sorted(values.items()))


def render_summary(config: RelaunchConfig, result: RunResult, console) -> None:
    """The closing summary: where to look, what came out, how the fault tolerance behaved."""
    s = result.steps
    prep, ev, reg, lau = (s[k].outputs for k in ("prepare", "evaluate", "register", "launch"))
    console.rule("summary")
    rows: list[tuple[str, str]] = []
    if prep.get("run_id"):
        from components.core.lineage import run_url

        browse = "open" if config.tracking.uri.startswith(("http://", "https://")) else "make ui, then open"
        rows.append(("MLflow run", f"{prep['run_id']} in experiment {config.tracking.experiment!r} at "
                                   f"{config.tracking.uri} — {browse} {run_url(config, prep['run_id'])}"))
        rows.append(("dataset", f"{prep.get('dataset_version')} at {prep.get('dataset_uri')}"))
    committed = _committed(config)
    if committed:
        rows.append(("checkpoints", f"{len(committed)} committed, newest {committed[-1]}"))
    if ev.get("checkpoint_uri"):
        rows.append(("evaluated", ev["checkpoint_uri"]))
        rows.append(("metrics", f"{config.evaluate.split} split: {_metrics(ev.get('metrics_json'))} — gate {config.evaluate.gate_metric}"
                                f" >= {config.evaluate.gate_min:g} {'passed' if ev.get('passed') else 'failed'}"))
    if reg.get("version"):
        rows.append(("model", f"{reg['model_name']} version {reg['version']}, aliases {', '.join(json.loads(reg['aliases']))}"
                              f" ({reg.get('champion_decision')})"))
    elif s["evaluate"].state == "succeeded":
        rows.append(("model", "not registered: the evaluation gate failed"))
    if lau:
        starts = json.loads(lau.get("resumed_from_steps") or "[]")
        resumed = [x for x in starts if x >= 0]
        rows.append(("training", f"{lau.get('train_seconds', 0):.1f}s training in {lau.get('duration_seconds', 0):.1f}s "
                                 f"launch; ETTR {lau.get('ettr', 0):.3f}"))
        launch_retries = max(0, s["launch"].attempts - 1)
        rows.append(("fault tolerance", f"{lau.get('restarts', 0)} torchrun restart(s), {launch_retries} launch retr"
                                        f"{'y' if launch_retries == 1 else 'ies'}; "
                                        + (f"resumed from step {', '.join(map(str, resumed))}" if resumed else "no resume")))
    rows.append(("took", f"{result.seconds:.1f}s; log {result.run_dir / 'pipeline.log'}"))
    for key, value in rows:
        console.print(f"  [bold]{key:<16}[/] {value}", highlight=False, soft_wrap=True)


def _committed(config: RelaunchConfig) -> list[str]:
    try:
        from components.locate import checkpoint_manager

        with checkpoint_manager(config) as mgr:
            return [c.uri for c in mgr.list()]
    except Exception:  # the summary must not fail a finished run
        return []
