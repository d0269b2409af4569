"""What ``relaunch tune`` prints: a line when a trial starts, reports a validation, resumes, is retried,
pruned, completes or fails, then the best trial, its evaluation and registration, and a summary. The
style of ``relaunch run``'s console (:mod:`relaunch.pipelines.local.console`): a mark, a fixed-width
subject, the detail; text that comes from a training (a reason, a path) is never read as markup."""

from __future__ import annotations

from typing import Any

from rich.markup import escape

from ...components.core.contract.exitcodes import MEANING


def params_text(params: dict[str, Any]) -> str:
    """``train.hidden_size=48 train.lr=0.0123``."""
    return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in sorted(params.items()))


def metrics_text(metrics: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.4f}" for k, v in sorted(metrics.items()))


class TuneConsole:
    """One line per event of the study on a ``rich.console.Console``."""

    def __init__(self, console):
        self.console = console

    def line(self, mark: str, subject: str, detail: str) -> None:
        self.console.print(f"  {mark} {subject:<10} {detail}", highlight=False, soft_wrap=True)

    def header(self, study: str, uri: str, tune, resumed: bool) -> None:
        how = "resuming" if resumed else "a new study"
        pruner = "no pruner" if tune.pruner.name == "none" else f"{tune.pruner.name} pruner"
        self.console.print(
            f"[bold]relaunch tune[/] — {how} [bold]{escape(study)}[/]: {tune.trials} trials, {tune.parallel} at once, "
            f"{tune.sampler.name} sampler seed {tune.sampler.seed}, {pruner}, objective {tune.objective.direction} "
            f"{escape(tune.objective.metric)}; {escape(uri)}", highlight=False, soft_wrap=True)

    def prepared(self, version: str, run_id: str, seconds: float) -> None:
        self.line("[green]✓[/]", "prepare", f"{seconds:5.1f}s  dataset {version}, MLflow run {run_id} (the study's)")

    def skipped(self, number: int, state: str, value: float | None, metric: str) -> None:
        detail = f"{metric} {value:.4f}" if value is not None else ""
        self.line("[dim]=[/]", f"trial {number}", f"{state} earlier{': ' + detail if detail else ''}; not run again")

    def started(self, number: int, params: dict[str, Any], run_id: str, resumed: bool) -> None:
        what = "resumed in its folder" if resumed else "started"
        self.line("[cyan]▶[/]", f"trial {number}", f"{what}: {params_text(params)} (MLflow run {run_id})")

    def reported(self, number: int, step: int, metrics: dict[str, float]) -> None:
        self.line("[blue]·[/]", f"trial {number}", f"step {step}: {metrics_text(metrics)}")

    def attempt(self, number: int, attempt: int, step: int) -> None:
        where = f"resumed from its checkpoint at step {step}" if step >= 0 else "started from scratch"
        self.line("[cyan]↳[/]", f"trial {number}", f"training attempt {attempt} {where}")

    def retrying(self, number: int, code: int, retry: int, limit: int) -> None:
        self.line("[yellow]↻[/]", f"trial {number}", f"exit {code} ({MEANING.get(code, 'unknown code')}): retry "
                  f"{retry}/{limit}, resuming from its own checkpoint")

    def pruned(self, number: int, step: int, why: str) -> None:
        self.line("[yellow]✂[/]", f"trial {number}", f"pruned at step {step} ({escape(why)}); stopping it (SIGTERM)")

    def completed(self, number: int, metric: str, value: float, step: int, seconds: float) -> None:
        self.line("[green]■[/]", f"trial {number}", f"complete: {metric} {value:.4f} at step {step} ({seconds:.1f}s)")

    def ended_pruned(self, number: int, step: int, code: int) -> None:
        self.line("[yellow]■[/]", f"trial {number}", f"pruned at step {step}; it stopped cleanly (exit {code}), not retried")

    def failed(self, number: int, code: int, reason: str) -> None:
        self.line("[red]■[/]", f"trial {number}", f"failed: exit {code} ({MEANING.get(code, 'unknown code')}): "
                  f"{escape(reason)}")

    def best(self, number: int, metric: str, value: float, params: dict[str, Any]) -> None:
        self.line("[bold green]★[/]", "best", f"trial {number}: {metric} {value:.4f} ({params_text(params)})")

    def evaluated(self, metrics_json: str, step: int, passed: bool, seconds: float) -> None:
        import json

        self.line("[green]✓[/]", "evaluate", f"{seconds:5.1f}s  {metrics_text(json.loads(metrics_json))} at step {step}, "
                  f"gate {'passed' if passed else 'failed'}")

    def registered(self, name: str, version: str, aliases: str, decision: str, seconds: float) -> None:
        self.line("[green]✓[/]", "register", f"{seconds:5.1f}s  {name} v{version} {aliases} ({escape(decision)})")

    def not_registered(self, why: str) -> None:
        self.line("[yellow]–[/]", "register", f"skipped: {escape(why)}")

    def summary(self, rows: list[tuple[str, str]]) -> None:
        self.console.rule("study")
        for key, value in rows:
            self.console.print(f"  [bold]{key:<14}[/] {escape(value)}", highlight=False, soft_wrap=True)
