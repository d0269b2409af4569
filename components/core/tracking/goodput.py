"""Goodput: the effective training time ratio over a training's attempts, and its figure.

From the attempt records of the run ledger (:mod:`relaunch.components.core.store.ledger`)
:func:`goodput_report` derives the effective training time ratio (ETTR = productive time / wall time
from the first start to the last end) and its breakdown:

    wall = productive + start-up + checkpoint stall + evaluation + recomputed steps + restart gaps

``recomputed`` is work done after the checkpoint the next attempt resumed from (lost, done again);
``restart gaps`` is the time between an attempt's end and the next one's start, and, for a worker
recovered in place (``train.memory_tier``: the attempt goes on), the time from its loss to the resume.
:func:`plot_goodput` draws the breakdown and the loss curve with every attempt's end marked.
"""

from __future__ import annotations

from typing import Any

from ..contract.exitcodes import ExitCode
from ..store.ledger import Attempt


def _step_time(a: Attempt, step: int) -> float:
    """When ``a`` finished ``step`` (recorded at a commit, else interpolated from its step rate)."""
    if str(step) in a.commits:
        return a.commits[str(step)][0]
    if a.loop_start is None or step <= a.resumed_from_step:
        return a.loop_start or a.start
    done = max(1, a.last_step - max(a.resumed_from_step, 0))
    rate = (a.ended - a.loop_start) / done
    return a.ended - max(0, a.last_step - step) * rate


def goodput_report(attempts: list[Attempt]) -> dict[str, Any]:
    """ETTR and its breakdown in seconds (keys: wall, productive, startup, checkpoint_stall,
    evaluation, recomputed, restart_gaps, ettr, attempts, resumed_from_steps)."""
    if not attempts:
        return {"ettr": 0.0, "wall": 0.0, "attempts": 0}
    wall = attempts[-1].ended - attempts[0].start
    startup = stall = evaluation = recomputed = gaps = 0.0
    for i, a in enumerate(attempts):
        loop_start = a.loop_start if a.loop_start is not None else a.ended
        startup += max(0.0, loop_start - a.start)
        stall += a.stall_seconds
        evaluation += a.eval_seconds
        for r in a.in_place:
            gaps += r["seconds"]
            resumed_at = r.get("resumed_at", a.commits.get(str(r["resumed_step"]), [None])[0])
            if resumed_at is not None:
                recomputed += max(0.0, r["lost_at"] - resumed_at)
        if i + 1 < len(attempts):
            nxt = attempts[i + 1]
            if a.loop_start is None:
                gaps += max(0.0, nxt.start - a.ended)
                continue
            resumed = nxt.resumed_from_step
            if resumed <= a.resumed_from_step:
                t_resume = a.loop_start
            elif nxt.resumed_from_time is not None:  # a step of ``a`` kept in memory: its time is known
                t_resume = min(nxt.resumed_from_time, nxt.start)
            else:
                t_resume = _step_time(a, resumed)
            # a record killed with its attempt is up to a heartbeat old: the steps up to the resumed one
            # were done (and kept) after it, so the gap starts at the later of the two
            gaps += max(0.0, nxt.start - max(a.ended, t_resume))
            overhead_then = a.commits.get(str(resumed), [0.0, None])[1]
            lost_overhead = (a.stall_seconds + a.eval_seconds - overhead_then) if overhead_then is not None else 0.0
            recomputed += max(0.0, a.ended - t_resume - max(0.0, lost_overhead))
    productive = max(0.0, wall - startup - stall - evaluation - recomputed - gaps)
    return {
        "ettr": productive / wall if wall > 0 else 0.0,
        "wall": wall, "productive": productive, "startup": startup, "checkpoint_stall": stall,
        "evaluation": evaluation, "recomputed": recomputed, "restart_gaps": gaps,
        "attempts": len(attempts), "resumed_from_steps": [a.resumed_from_step for a in attempts],
        "last_steps": [a.last_step for a in attempts], "exit_codes": [a.outcome for a in attempts],
        "in_place": [r for a in attempts for r in a.in_place],
    }


ENDINGS = {ExitCode.KILLED: "killed (SIGKILL, OOM)", ExitCode.PREEMPTED: "preempted (SIGTERM)",
           ExitCode.RETRY_ME: "transient failure", ExitCode.INTERRUPTED: "interrupted (SIGINT)"}
"""How an attempt's end reads in the goodput legend: the exit code's meaning in a few words."""


def _ending(code: int | None) -> str:
    """``exit 137, killed (SIGKILL, OOM)``: the legend's words for an attempt's exit code."""
    return f"exit {code}, {ENDINGS[code]}" if code in ENDINGS else f"exit {code}"


BREAKDOWN = ("productive", "startup", "checkpoint_stall", "evaluation", "recomputed", "restart_gaps")


def plot_goodput(report: dict[str, Any], loss_curve: list[tuple[int, float]], path: str) -> str:
    """One PNG: the wall-time breakdown as one stacked bar (legend below it, never over it), and the
    loss curve with every attempt's end marked and the steps done twice shaded. Returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (bar, loss) = plt.subplots(1, 2, figsize=(12, 4.8), gridspec_kw={"width_ratios": [1, 1.6]})
    wall = float(report.get("wall", 0.0)) or 1.0
    left = 0.0
    for name in BREAKDOWN:
        value = float(report.get(name, 0.0))
        bar.barh([0], [value], left=left, height=0.5,
                 label=f"{name.replace('_', ' ')}: {value:.1f} s ({100 * value / wall:.0f}%)")
        left += value
    bar.set_yticks([])
    bar.set_xlabel("wall time, seconds")
    bar.set_ylim(-0.5, 0.5)
    bar.set_title(f"ETTR {report.get('ettr', 0.0):.3f} over {report.get('attempts', 0)} attempt(s)")
    bar.legend(loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=2, fontsize=8, frameon=False)
    if loss_curve:
        steps, losses = zip(*sorted(loss_curve))
        loss.plot(steps, losses, color="tab:blue", label="train loss")
    resumed = list(report.get("resumed_from_steps", []))
    ends = list(report.get("last_steps", []))
    codes = list(report.get("exit_codes", []))
    for i in range(len(resumed) - 1):
        end, code, again = (ends[i] if i < len(ends) else -1), (codes[i] if i < len(codes) else None), resumed[i + 1]
        if end >= 0:
            loss.axvline(end, color="tab:red", linewidth=1.5,
                         label=f"attempt {i + 1} ended at step {end}: {_ending(code)}")
        if 0 <= again < end:
            loss.axvspan(again, end, color="tab:orange", alpha=0.25,
                         label=f"recomputed: steps {again + 1}-{end}")
        if again >= 0:
            loss.axvline(again, color="tab:green", linestyle="--", linewidth=1,
                         label=f"attempt {i + 2} resumed from step {again}")
    for r in report.get("in_place", []):
        lost, again = int(r["lost_at_step"]), int(r["resumed_step"])
        loss.axvline(lost, color="tab:purple", linewidth=1.5,
                     label=f"worker lost at step {lost}: recovered in place from {r['source']} "
                           f"in {float(r['seconds']):.2f} s")
        if 0 <= again < lost:
            loss.axvspan(again, lost, color="tab:purple", alpha=0.15, label=f"recomputed: steps {again + 1}-{lost}")
    loss.set_xlabel("step")
    loss.set_ylabel("train loss")
    loss.set_title("loss, restarts and recomputed steps")
    loss.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90, bbox_inches="tight")
    plt.close(fig)
    return path
