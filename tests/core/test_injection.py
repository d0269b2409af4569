"""Injected faults fire once per training (components/core/trainer/injection.py)."""

from __future__ import annotations

from relaunch.components.core.trainer.injection import Injection, OutageStore, wrap_store
from relaunch.components.core.store import open_store


def test_an_injected_storage_outage_fires_once_per_training_and_only_on_rank_0(tmp_path):
    store = open_store(str(tmp_path))
    other_rank = Injection("storage-outage@step=3", store, rank=1, world=2, pids=[])
    other_rank.before_step(3)
    assert other_rank.outage_until == 0.0
    first = Injection("storage-outage@step=3", store, rank=0, world=2, pids=[])
    first.before_step(2)
    assert first.outage_until == 0.0
    first.before_step(3)
    assert first.outage_until > 0.0
    resumed = Injection("storage-outage@step=3", store, rank=0, world=2, pids=[])  # a restarted attempt
    resumed.before_step(3)
    assert resumed.outage_until == 0.0


def test_only_a_storage_outage_wraps_the_store(tmp_path):
    store = open_store(str(tmp_path))
    assert wrap_store(store, Injection(None, store, 0, 1, [])) is store
    assert wrap_store(store, Injection("kill-worker@step=5", store, 0, 1, [])) is store
    wrapped = wrap_store(store, Injection("storage-outage@step=5", store, 0, 1, []))
    assert isinstance(wrapped, OutageStore) and wrapped.uri == store.uri
