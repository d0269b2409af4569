"""The run ledger (components/core/store/ledger.py): attempt records as stored, and the summary's end."""

from __future__ import annotations

from relaunch.components.core.store import ledger, open_store


def test_an_attempt_log_keeps_an_in_place_recovery_in_the_stored_record(tmp_path):
    store = open_store(str(tmp_path / "store"))
    log = ledger.AttemptLog(store, ledger.claim_attempt(store, 0.0, 2))
    log.recovered_in_place(lost_at_step=30, resumed_step=20, lost_at=9.0, seconds=0.5, source="memory")
    (stored,) = ledger.load_attempts(store)
    assert stored.in_place == [{"lost_at_step": 30, "resumed_step": 20, "lost_at": 9.0, "seconds": 0.5,
                                "source": "memory"}]


def test_a_summary_reached_the_end_only_when_it_finished_every_step():
    done = ledger.TrainSummary(exit_code=0, reason="finished", run_id="r", attempt=1, last_step=76, total_steps=76)
    assert done.reached_the_end
    assert not ledger.TrainSummary(exit_code=0, reason="", run_id="r", attempt=1, last_step=40, total_steps=76).reached_the_end
    assert not ledger.TrainSummary(exit_code=143, reason="", run_id="r", attempt=1, last_step=76,
                                   total_steps=76).reached_the_end
