"""The training bench's own parts, untimed: a restart's phases add up to its MTTR whatever order
the marks came in, and the figure is drawn from the rows' data."""

from __future__ import annotations

import pytest

from relaunch.components.core.store.ledger import Attempt
from tests.bench.bench_training import PHASES, final_save_seconds, long_run_ettr, plot_breakdown, restart_phases


def _attempt(created: float = 101.0) -> Attempt:
    return Attempt(attempt=2, start=101.05, created=created, first_step_time=104.0,
                   phases={"imports": 1.0, "process_group": 1.2, "data": 1.5, "build": 2.0, "resume": 2.5})


@pytest.mark.parametrize("gone, created", [(100.3, 101.0), (None, 101.0), (101.5, 101.0), (99.0, 101.0),
                                           (100.3, None)])
def test_a_restarts_phases_add_up_to_kill_to_first_step_and_none_is_negative(gone, created):
    phases = restart_phases(100.0, gone, _attempt(created))
    assert list(phases) == list(PHASES)
    assert sum(phases.values()) == pytest.approx(4.0)
    assert min(phases.values()) >= 0


def test_the_phases_are_the_intervals_between_the_marks():
    phases = restart_phases(100.0, 100.3, _attempt())
    assert phases == pytest.approx({"detection": 0.3, "rendezvous": 0.7, "process start + imports": 1.05,
                                    "process-group init": 0.2, "task + data": 0.3, "model + optimiser": 0.5, "lease + checkpoint load": 0.5,
                                    "first step": 0.45})


def test_the_figure_is_written_from_the_breakdowns(tmp_path):
    report = {"ettr": 0.8, "wall": 10.0, "productive": 8.0, "startup": 1.0, "restart_gaps": 1.0}
    killed = [{"name": f"{how}-killed", "kills": 2, "report": report, "phases": [restart_phases(100.0, 100.3, _attempt())] * 2}
              for how in ("cold", "warm", "inplace", "inplace-warm")]
    plain = [{"name": f"{how}-plain", "report": {**report, "ettr": 0.95}}
             for how in ("cold", "warm", "inplace", "inplace-warm")]
    path = plot_breakdown(killed, plain, 1.8, tmp_path / "figures" / "b.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_long_runs_steady_loss_leaves_out_the_first_start_and_the_final_save():
    # 100 s undisturbed: 2 s start-up, 0.5 s of stall of which the final save took 0.4 s
    last = Attempt(attempt=1, start=0.0, last_step=500, stall_seconds=0.5, commits={"250": [50.0, 0.05], "500": [99.0, 0.1]})
    assert final_save_seconds(last) == pytest.approx(0.4)
    plain = {"kills": 0, "final_save": 0.4, "report": {"wall": 100.0, "productive": 97.5, "startup": 2.0}}
    killed = {"kills": 2, "report": {"wall": 101.0, "productive": 98.1}}  # 0.4 s more lost: 0.2 s a kill
    steady = 0.1 / (100.0 - 2.4)
    assert long_run_ettr(killed, plain) == pytest.approx(1 - 0.2 / 60 - steady)
