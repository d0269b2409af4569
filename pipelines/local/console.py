"""What ``relaunch run`` prints: a line per step, lines per training attempt (where it started, the
checkpoints it saved, how it ended: its exit code and the reason in words), and the training's progress bar while the pipeline runs (:class:`RunView`, tailing the run's event file with
:func:`relaunch.components.core.contract.events.read_file`), then the closing summary (:func:`render_summary`).
"""

from __future__ import annotations

import dataclasses
import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from rich.markup import escape

from ...components.core.checkpoint import CheckpointManager
from ..spec import EVALUATE, FINALIZE, LAUNCH, LOCATE, PREPARE, REGISTER, STEP_TABLE
from ...components.core.contract.config import RelaunchConfig, memory_tier_on
from ...components.core.contract.events import Event, Kind, read_file
from ...components.core.contract.exitcodes import MEANING, ExitCode, is_retryable, unrecorded_end
from ...components.core.store import records
from ...components.core.tracking.context import Context
from ...components.core.tracking.lineage import run_url

STEPS = tuple(STEP_TABLE)  # the five steps and the exit task


@dataclass
class StepRecord:
    """What the events said about one step."""

    state: str = "pending"  # pending | running | succeeded | failed | skipped
    attempts: int = 0
    started: float = 0.0
    seconds: float = 0.0
    exit_code: int | None = None
    message: str = ""
    outputs: Any = None
    """The step's outputs dataclass (:data:`relaunch.pipelines.spec.STEP_TABLE`) once it succeeded, else None."""


def step_outputs(step: str, values: dict[str, Any]) -> Any:
    """The outputs dataclass of ``step`` from the values its end event carried (unknown keys ignored)."""
    cls = STEP_TABLE[step].outputs_class()
    return cls(**{f.name: values[f.name] for f in dataclasses.fields(cls) if f.name in values})


class RunView:
    """Tails the event file: prints a line per step and draws the training's progress bar."""

    def __init__(self, console, events: Path, log: Path,
                 committed_steps: Callable[[int], set[int] | None] | None = None):
        """``committed_steps``: ``attempt -> the steps it committed`` as the store records them (None
        when unknown); without it, or when it knows nothing, an attempt's summary event says up to which
        step its checkpoints committed."""
        self.console, self.events, self.log = console, events, log
        self._committed_steps = committed_steps
        self.interrupted = False  # the run was stopped (Ctrl-C): an attempt that ends now is not retried
        self.steps = {s: StepRecord() for s in STEPS}
        self.resumed: list[dict[str, Any]] = []  # each training attempt's resumed event
        self.saved: list[dict[str, Any]] = []  # each checkpoint's saving event
        self.ended: dict[int, dict[str, Any]] = {}  # attempt -> how it ended (its summary event)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="relaunch-run-view")
        self._progress = None
        self._bar = None
        self._offset = 0
        self._unprinted_saves: list[Event] = []

    def start(self) -> None:
        self.console.print(f"[bold]relaunch run[/] — steps run by kfp.local; full log: {self.log}", soft_wrap=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self._drain()
        self._print_saves()
        self._end_bar()

    def _loop(self) -> None:
        while not self._stop.wait(0.2):
            self._drain()

    def _drain(self) -> None:
        found, self._offset = read_file(self.events, self._offset)
        for ev in found:
            self._handle(ev)

    def _print(self, text: str) -> None:
        (self._progress.console if self._progress else self.console).print(text, highlight=False, soft_wrap=True)

    def _handle(self, ev: Event) -> None:
        kind, step = ev.kind, ev.get("step")
        if kind == Kind.STEP_START and step in self.steps:
            rec = self.steps[step]
            rec.state, rec.attempts, rec.started = "running", rec.attempts + 1, ev.time
        elif kind == Kind.STEP_END and step in self.steps:
            self._print_saves()
            self._step_end(self.steps[step], step, ev)
        elif kind == Kind.ATTEMPT_END and step in self.steps and ev["exit_code"] and self.steps[step].state == "running":
            self._print_saves()
            rec = self.steps[step]  # the step's process ended without reporting: killed, or kfp.local failed it
            rec.state, rec.exit_code, rec.seconds = "failed", ev["exit_code"], ev.time - rec.started
            rec.message = f"its process ended without a report ({MEANING.get(ev['exit_code'], 'unknown code')})"
            self._print(f"  [red]✗[/] {step:<26} {rec.seconds:6.1f}s  exit {rec.exit_code}: {rec.message}")
        elif kind == Kind.RETRY:
            code = ev["exit_code"]
            self._print(f"  [yellow]↻[/] {ev['step']:<26} retry {ev['attempt']}/{ev['limit']} in {ev['delay']:.0f}s "
                        f"(exit {code}: {MEANING.get(code, 'unknown')})")
        elif kind == Kind.SUMMARY:
            self.ended[int(ev.get("attempt", 0) or 0)] = {"time": ev.time, **ev.fields}  # what its saves became
            self._print_saves()
            self._attempt_end(ev)
        elif kind == Kind.RESUMED:
            self._print_saves()
            self._attempts_ended_without_a_word(int(ev.get("attempt", 0) or 0))
            self.resumed.append({"time": ev.time, **ev.fields})
            where = f"resumed from step {ev['step']}" if int(ev.get("step", -1)) >= 0 else "started from scratch"
            if ev.get("in_place"):  # train.memory_tier: a killed worker replaced, its peers kept their processes
                where = (f"recovered in place from {ev.get('source', '?')} at step {ev['step']} (a worker lost at step "
                         f"{ev.get('lost_at_step', '?')}; {float(ev.get('recovery_seconds', 0)):.2f}s, "
                         f"{ev.get('store_bytes_read', '?')} bytes read from the store)")
            self._print(f"    [cyan]↳[/] training attempt {ev.get('attempt', '?')} {where}")
        elif kind == Kind.SAVING:
            self.saved.append({"time": ev.time, **ev.fields})
            self._unprinted_saves.append(ev)
        elif kind == Kind.PROGRESS:
            self._progress_update(ev)
        elif kind == Kind.WAITING:  # a path or a bracket in the line: never markup
            self._print(f"    [yellow]…[/] {escape(str(ev.get('line', '')))}")
        elif kind in (Kind.TRACKING, Kind.STORE):  # a server's own words or a path in the line: never markup
            self._print(f"    [yellow]![/] {escape(str(ev.get('line', '')))}")

    def _attempt_end(self, ev: Event) -> None:
        """``attempt 1: preempted by SIGTERM at step 31: checkpoint at step 31 committed -> exit 143, retrying``."""
        attempt, code = int(ev.get("attempt", 0) or 0), int(ev.get("exit_code", 1))
        self.ended[attempt] = {"time": ev.time, **ev.fields}
        if code == ExitCode.OK:
            self._print(f"    [green]■[/] attempt {attempt} finished at step {ev.get('last_step', '?')} -> exit 0")
            return
        reason = str(ev.get("reason") or MEANING.get(code, "unknown code"))
        after = "stopped with the run" if self.interrupted else "retrying" if is_retryable(code) else "not retried"
        # the reason is the training's own text (a path, a bracket): never markup
        self._print(f"    [red]■[/] attempt {attempt}: {escape(reason)} -> exit {code}, {after}")

    def _attempts_ended_without_a_word(self, attempt: int) -> None:
        """Attempts before ``attempt`` (just started) that sent no summary: rank 0 was killed, or was ended
        with a lost peer before it could say so (which rank died is not known here)."""
        earlier = [n for n in range(max(self.ended, default=0) + 1, attempt)
                   if n not in self.ended and any(r.get("attempt") == n for r in self.resumed)]
        for n in earlier:
            code = unrecorded_end(None)
            self.ended[n] = {"exit_code": code}
            self._print(f"    [red]■[/] attempt {n} ended before rank 0 could report it: taken as {MEANING[code]} -> exit {code}, retrying")

    def _print_saves(self) -> None:
        """One line for the checkpoints an attempt saved, once it ended (or the next one started): the
        steps whose checkpoint committed, and apart those whose save only started."""
        saves, self._unprinted_saves = self._unprinted_saves, []
        if not saves:
            return
        attempt = saves[0].get("attempt", "?")
        committed = self._committed(attempt)
        steps = [int(e.get("step", -1)) for e in saves]
        done = [s for s in steps if committed is not None and s in committed]
        started = [s for s in steps if s not in done]
        parts = []
        if done:
            parts.append(f"saved checkpoints at {_steps(done)}")
        if started:
            unknown = committed is None
            parts.append(f"{'started' if done else 'started checkpoints at'} {_steps(started)}"
                         + (" (not known to have committed)" if unknown else ", not committed"))
        self._print(f"    [blue]↓[/] attempt {attempt} {'; '.join(parts)}")

    def _committed(self, attempt) -> set[int] | None:
        """The steps ``attempt`` committed: the store's record of it, else its summary event's last
        committed step (saves are sequential: each waits for the one before to commit); None if unknown."""
        if self._committed_steps is not None and isinstance(attempt, int):
            found = self._committed_steps(attempt)
            if found is not None:
                return found
        ended = self.ended.get(attempt) if isinstance(attempt, int) else None
        if ended is None or "last_committed_step" not in ended:
            return None
        last = int(ended.get("last_committed_step") if ended.get("last_committed_step") is not None else -1)
        return {int(e.get("step", -1)) for e in self.saved if e.get("attempt") == attempt and int(e.get("step", -1)) <= last}

    def _step_end(self, rec: StepRecord, step: str, ev: Event) -> None:
        rec.seconds = ev.time - rec.started
        rec.exit_code, rec.message = ev.get("exit_code", 0), ev.get("message", "")
        rec.state = "succeeded" if rec.exit_code == 0 else "failed"
        if rec.exit_code == 0:
            rec.outputs = step_outputs(step, ev.get("outputs", {}))
        if step == LAUNCH.name:
            self._end_bar()
        mark = "[green]✓[/]" if rec.exit_code == 0 else "[red]✗[/]"
        # a failure's message is the step's own text (a gloo error names "[/path/pair.cc:553]"): never markup
        detail = escape(_detail(step, rec)) if rec.exit_code == 0 else f"exit {rec.exit_code}: {escape(rec.message)}"
        self._print(f"  {mark} {step:<26} {rec.seconds:6.1f}s  {detail}")
        if step == EVALUATE.name and rec.exit_code == 0 and not rec.outputs.passed:
            self.steps[REGISTER.name].state = "skipped"
            self._print(f"  [yellow]–[/] {REGISTER.name:<26} {'':>7}  skipped: the evaluation gate failed")

    def _progress_update(self, ev: Event) -> None:
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


def _steps(steps: list[int]) -> str:
    return f"step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))}"


def _detail(step: str, rec: StepRecord) -> str:
    o = rec.outputs
    if step == PREPARE.name:
        return f"dataset {o.dataset_version}, MLflow run {o.run_id}"
    if step == LOCATE.name:
        return f"{o.source}: step {o.step}" if o.checkpoint_uri else "no checkpoint: fresh start"
    if step == LAUNCH.name:
        return f"{o.train_seconds:.1f}s training, {o.restarts} restart(s), ETTR {o.ettr:.3f}"
    if step == EVALUATE.name:
        return f"{_metrics(o.metrics_json)} at step {o.step}, gate {'passed' if o.passed else 'failed'}"
    if step == REGISTER.name:
        return f"{o.model_name} v{o.version} {o.aliases}"
    if step == FINALIZE.name:
        return f"MLflow run {o.status}"
    return ""


def _ettr(ettr: float) -> str:
    """The summary's ETTR with what it counts: goodput's productive seconds over the wall time from the
    training's first attempt to its last (a pause between a Ctrl-C and ``--resume`` included), not the
    ratio of the two figures before it."""
    return f"ETTR {ettr:.2f} (productive training time / wall time since the training's first attempt)"


def _metrics(text: str | None) -> str:
    try:
        values = json.loads(text or "{}")
    except ValueError:
        return str(text)
    return ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in sorted(values.items()))


def render_summary(config: RelaunchConfig, result, console, *, context: Context | None = None) -> None:
    """The closing summary: where to look, what came out, how the fault tolerance behaved (``context``:
    ``config``'s, when the caller has one)."""
    s = result.steps
    prep, ev, reg, lau = (s[k].outputs for k in (PREPARE.name, EVALUATE.name, REGISTER.name, LAUNCH.name))
    console.rule("summary")
    rows: list[tuple[str, str]] = []
    if prep is not None and prep.run_id:
        browse = "open" if config.tracking.uri.startswith(("http://", "https://")) else "make ui, then open"
        rows.append(("MLflow run", f"{prep.run_id} in experiment {config.tracking.experiment!r} at "
                                   f"{config.tracking.uri} — {browse} {run_url(config, prep.run_id, prep.experiment_id)}"))
        rows.append(("dataset", f"{prep.dataset_version} at {prep.dataset_uri}"))
    committed = _committed(config)
    if committed:
        rows.append(("checkpoints", f"{len(committed)} committed, newest {committed[-1]}"))
    if ev is not None and ev.checkpoint_uri:
        rows.append(("evaluated", ev.checkpoint_uri))
        rows.append(("metrics", f"{config.evaluate.split} split: {_metrics(ev.metrics_json)} — gate {config.evaluate.gate_metric}"
                                f" >= {config.evaluate.gate_min:g} {'passed' if ev.passed else 'failed'}"))
    if reg is not None and reg.version:
        rows.append(("model", f"{reg.model_name} version {reg.version}, aliases {', '.join(json.loads(reg.aliases))}"
                              f" ({reg.champion_decision})"))
    elif s[EVALUATE.name].state == "succeeded" and lau is not None and not lau.completed:
        rows.append(("model", "not registered: the training did not reach its end"))
    elif s[EVALUATE.name].state == "succeeded":
        rows.append(("model", "not registered: the evaluation gate failed"))
    if lau is not None:
        resumed = [x for x in json.loads(lau.resumed_from_steps or "[]") if x >= 0]
        if lau.duration_seconds or lau.job_name:
            rows.append(("training", f"{lau.train_seconds:.1f}s training in {lau.duration_seconds:.1f}s "
                                     f"launch; {_ettr(lau.ettr)}"))
        else:  # a finish-only resume: launch found the training at its end and started nothing
            rows.append(("training", f"nothing launched: trained earlier ({lau.train_seconds:.1f}s of training); "
                                     f"{_ettr(lau.ettr)}"))
        launch_retries = max(0, s[LAUNCH.name].attempts - 1)
        restarter = ("Ray round" if config.launch.backend == "ray" else
                     "in-place agent" if config.launch.backend == "local" and memory_tier_on(config) else "torchrun")
        in_place = _in_place_recoveries(context if context is not None else Context(config))
        replaced = f", {len(in_place)} worker(s) replaced in place" if in_place else ""
        rows.append(("fault tolerance", f"{lau.restarts} {restarter} restart(s){replaced}, {launch_retries} launch retr"
                                        f"{'y' if launch_retries == 1 else 'ies'}"
                                        + (f"; resumed from step {', '.join(map(str, resumed))}" if resumed
                                           else "" if in_place else "; no resume")))
        for r in in_place:
            rows.append(("recovered", f"in place from {r['source']}: a worker lost at step {r['lost_at_step']}, "
                                      f"resumed at step {r['resumed_step']} in {float(r['seconds']):.2f}s "
                                      f"(its peers kept their processes)"))
    rows.append(("took", f"{result.seconds:.1f}s; log {result.run_dir / 'pipeline.log'}"))
    for key, value in rows:
        console.print(f"  [bold]{key:<16}[/] {value}", highlight=False, soft_wrap=True)


def _in_place_recoveries(context: Context) -> list[dict[str, Any]]:
    """The training's recoveries of a lost worker inside an attempt (``train.memory_tier``), from its summary."""
    try:
        summary = records.read_summary(context.store) or {}
    except Exception:  # the summary must not fail a finished run
        return []
    return list((summary.get("goodput") or {}).get("in_place") or [])


def _committed(config: RelaunchConfig) -> list[str]:
    try:
        with CheckpointManager.from_config(config, async_save=False) as mgr:
            return [c.uri for c in mgr.list()]
    except Exception:  # the summary must not fail a finished run
        return []
