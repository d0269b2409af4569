"""The goodput report and its figure (components/core/tracking/goodput.py), and the torchrun exit mapping
over the ledger's exit record."""

from __future__ import annotations

import json

import pytest

from relaunch.components.core.store import ledger, records
from relaunch.components.core.tracking import goodput
from relaunch.components.core.contract.classify import torchrun_exit
from relaunch.components.core.store import open_store


def _attempt(n, start, loop, last_step, seen, resumed=-1, commits=None, end=None, stall=0.0, exit_code=None):
    return ledger.Attempt(attempt=n, start=start, loop_start=loop, first_step_time=loop + 0.1, last_step=last_step,
                          last_seen=seen, resumed_from_step=resumed, commits=commits or {}, end=end,
                          stall_seconds=stall, exit_code=exit_code)


def _killed_then_finished():
    first = _attempt(1, 0.0, 2.0, 50, 12.0, commits={"40": [10.0, 0.5]}, stall=0.5)  # killed at 12 s, no end
    second = _attempt(2, 14.0, 15.0, 100, 25.0, resumed=40, end=25.0, stall=0.5, exit_code=0)
    return [first, second]


def test_goodput_report_splits_the_wall_time_into_productive_startup_stall_recomputed_and_gaps():
    report = goodput.goodput_report(_killed_then_finished())
    assert report["wall"] == 25.0
    assert report["startup"] == pytest.approx(3.0)       # 2 s + 1 s
    assert report["restart_gaps"] == pytest.approx(2.0)  # 12 -> 14
    assert report["recomputed"] == pytest.approx(2.0)    # steps 40..50 done again: 10 s -> 12 s
    assert report["checkpoint_stall"] == pytest.approx(1.0)
    assert report["productive"] == pytest.approx(17.0)
    assert report["ettr"] == pytest.approx(17.0 / 25.0)
    assert (report["last_steps"], report["exit_codes"]) == ([50, 100], [137, 0])


def test_the_goodput_figure_is_one_png_with_the_breakdown_and_the_marked_loss_curve(tmp_path):
    report = goodput.goodput_report(_killed_then_finished())
    path = goodput.plot_goodput(report, [(s, 2.0 / s) for s in range(1, 101)], str(tmp_path / "goodput.png"))
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_a_worker_recovered_in_place_counts_its_recovery_as_a_gap_and_its_lost_steps_as_recomputed(tmp_path):
    one = _attempt(1, 0.0, 2.0, 100, 30.0, commits={"20": [6.0, 0.0]}, end=30.0, exit_code=0)
    one.in_place = [{"lost_at_step": 30, "resumed_step": 20, "lost_at": 9.0, "seconds": 0.5, "source": "memory"}]
    report = goodput.goodput_report([one])
    assert report["attempts"] == 1
    assert report["restart_gaps"] == pytest.approx(0.5)  # lost at 9 s, training again 0.5 s later
    assert report["recomputed"] == pytest.approx(3.0)    # steps 21..30 done again: committed at 6 s, lost at 9 s
    assert report["productive"] == pytest.approx(30.0 - 2.0 - 0.5 - 3.0)
    assert report["in_place"][0]["source"] == "memory"
    path = goodput.plot_goodput(report, [(s, 2.0 / s) for s in range(1, 101)], str(tmp_path / "goodput.png"))
    assert open(path, "rb").read()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_step_kept_in_memory_counts_from_its_own_time_not_from_a_commit_or_a_stale_record():
    # rank 0 killed at ~13 s; its record last written at 12 s (step 50); the new attempt resumed from the
    # snapshot of step 55, done at 12.5 s: 12 -> 12.5 s was productive, 12.5 -> 14 s lost
    first = _attempt(1, 0.0, 2.0, 50, 12.0, commits={"40": [10.0, 0.5]}, stall=0.5)
    second = _attempt(2, 14.0, 15.0, 100, 25.0, resumed=55, end=25.0, stall=0.5, exit_code=0)
    second.resumed_from_time = 12.5
    report = goodput.goodput_report([first, second])
    assert report["restart_gaps"] == pytest.approx(1.5)
    assert report["recomputed"] == pytest.approx(0.0)
    assert report["productive"] == pytest.approx(25.0 - 3.0 - 1.0 - 1.5)
    # a survivor's recovery from a snapshot of step 28 done at 8.8 s: 0.2 s recomputed, not 3 s from the commit
    one = _attempt(1, 0.0, 2.0, 100, 30.0, commits={"20": [6.0, 0.0]}, end=30.0, exit_code=0)
    one.in_place = [{"lost_at_step": 30, "resumed_step": 28, "lost_at": 9.0, "seconds": 0.5, "source": "memory",
                     "resumed_at": 8.8}]
    assert goodput.goodput_report([one])["recomputed"] == pytest.approx(0.2)


@pytest.mark.parametrize("rc,record,expected", [
    (0, None, 0),
    (1, {"exit_code": 143, "time": 10.0}, 143),
    (1, {"exit_code": 2, "time": 10.0}, 2),
    (1, {"exit_code": 3, "time": 1.0}, 137),  # a record of an older run does not count
    (1, None, 137),                           # a worker died without a word: SIGKILL / OOM
    (-9, None, 137),
    (-15, None, 143),
])
def test_torchrun_exit_status_maps_to_the_contract(tmp_path, rc, record, expected):
    store = open_store(str(tmp_path))
    if record:
        store.write_bytes(records.EXIT_KEY, json.dumps(record).encode())
    assert torchrun_exit(rc, records.read_exit_record(store), 5.0) == expected
