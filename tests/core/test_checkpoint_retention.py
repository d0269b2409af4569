"""Ordering and retention edge cases: numeric step order, keep_last=1, keep_best with ties, pins,
the latest pointer, and debris of crashed saves."""

from __future__ import annotations

import pytest

from relaunch.components.core.checkpoint import CheckpointManager, parse_checkpoint_uri, step_key
from relaunch.components.core.contract.errors import BadInput, CorruptCheckpoint
from relaunch.components.core.store import open_store
from tests.core.helpers import make_state, train_steps


def _save_all(mgr, steps_metrics):
    state = make_state()
    for step, metric in steps_metrics:
        train_steps(state, 1)
        mgr.save(step, state, metrics={} if metric is None else {"val_loss": metric})
        mgr.wait()
    return state


def test_step_10000_is_newer_than_step_9000_even_when_the_pointer_is_gone(tmp_path):
    mgr = CheckpointManager(str(tmp_path), keep_last=0)
    _save_all(mgr, [(9000, None), (10000, None), (999, None)])
    mgr.store.delete("checkpoints/latest.json")
    mgr.store.delete("checkpoints/inflight.json")
    assert mgr.latest().step == 10000
    assert [i.step for i in mgr.list()] == [999, 9000, 10000]


RETENTION_CASES = [
    # (manager kwargs, [(step, val_loss)], kept steps)
    ("keep_last=1 keeps only the newest", dict(keep_last=1), [(1, None), (2, None), (3, None)], [3]),
    ("keep_last=2", dict(keep_last=2), [(1, None), (2, None), (3, None), (4, None)], [3, 4]),
    ("keep_last=0 keeps everything", dict(keep_last=0), [(1, None), (2, None), (3, None)], [1, 2, 3]),
    ("keep_best=1 keeps the best besides the last", dict(keep_last=1, keep_best=1, best_metric="val_loss"),
     [(1, 0.5), (2, 0.1), (3, 0.9), (4, 0.7)], [2, 4]),
    ("keep_best with a tie keeps the newer of the tied", dict(keep_last=1, keep_best=1, best_metric="val_loss"),
     [(1, 0.2), (2, 0.2), (3, 0.9), (4, 0.8)], [2, 4]),
    ("keep_best=2 with ties", dict(keep_last=1, keep_best=2, best_metric="val_loss"),
     [(1, 0.2), (2, 0.3), (3, 0.2), (4, 0.9), (5, 0.95)], [1, 3, 5]),
    ("mode=max keeps the highest", dict(keep_last=1, keep_best=1, best_metric="val_loss", mode="max"),
     [(1, 0.5), (2, 0.9), (3, 0.1), (4, 0.2)], [2, 4]),
    ("checkpoints without the metric never count as best", dict(keep_last=1, keep_best=1, best_metric="val_loss"),
     [(1, None), (2, 0.4), (3, None), (4, None)], [2, 4]),
]


@pytest.mark.parametrize("kwargs,history,kept", [c[1:] for c in RETENTION_CASES], ids=[c[0] for c in RETENTION_CASES])
def test_retention_keeps_exactly_the_last_and_best(tmp_path, kwargs, history, kept):
    mgr = CheckpointManager(str(tmp_path), **kwargs)
    _save_all(mgr, history)
    assert [i.step for i in mgr.list()] == kept
    assert mgr.latest().step == history[-1][0]


def test_a_pinned_checkpoint_survives_retention_until_unpinned(tmp_path):
    mgr = CheckpointManager(str(tmp_path), keep_last=1)
    state = _save_all(mgr, [(1, None), (2, None)])
    with pytest.raises(CorruptCheckpoint):
        mgr.pin(1, "registered model v1")  # step 1 is already gone: only committed steps can be pinned
    mgr.pin(2, "registered model v1")
    for step in (3, 4):
        train_steps(state, 1)
        mgr.save(step, state)
        mgr.wait()
    assert [i.step for i in mgr.list()] == [2, 4]
    assert mgr.pins() == {2: ["registered-model-v1"]}
    mgr.unpin(2, "registered model v1")
    mgr.save(5, state)
    mgr.wait()
    assert [i.step for i in mgr.list()] == [5]


def test_retention_never_deletes_what_latest_json_points_at(tmp_path):
    mgr = CheckpointManager(str(tmp_path), keep_last=1)
    _save_all(mgr, [(5, None), (7, None)])
    # someone loads and re-trains from an older branch: latest.json keeps pointing at what it names
    assert mgr.latest().step == 7
    assert [i.step for i in mgr.list()] == [7]


def test_debris_of_a_crashed_save_is_removed_but_the_save_in_flight_is_not(tmp_path):
    store = open_store(str(tmp_path))
    store.write_bytes(f"{step_key(3)}/__0_0.distcp", b"half a shard")  # a crashed save, no manifest
    mgr = CheckpointManager(store, keep_last=2)
    _save_all(mgr, [(1, None), (2, None)])
    assert not store.list(step_key(3) + "/")
    assert [i.step for i in mgr.list()] == [1, 2]


def test_saving_a_step_that_is_already_committed_is_refused(tmp_path):
    mgr = CheckpointManager(str(tmp_path), keep_last=0)
    state = _save_all(mgr, [(1, None)])
    before = mgr.store.read_bytes(f"{step_key(1)}/MANIFEST.json")
    mgr.save(1, state)
    with pytest.raises(BadInput, match="already committed"):
        mgr.wait()
    assert mgr.store.read_bytes(f"{step_key(1)}/MANIFEST.json") == before


@pytest.mark.parametrize("uri,expected", [
    ("/a/b/checkpoints/step-000000000042", ("/a/b", 42)),
    ("s3://bkt/exp/run/checkpoints/step-000000010000/", ("s3://bkt/exp/run", 10000)),
    ("file:///x/checkpoints/step-000000000001/MANIFEST.json", ("file:///x", 1)),
])
def test_a_checkpoint_uri_parses_back_to_its_store_and_step(uri, expected):
    assert parse_checkpoint_uri(uri) == expected


@pytest.mark.parametrize("uri", ["/a/b", "/a/checkpoints/step-42", "s3://b/checkpoints/latest.json", ""])
def test_a_malformed_checkpoint_uri_is_bad_input(uri):
    with pytest.raises(BadInput):
        parse_checkpoint_uri(uri)


def test_load_by_uri_restores_that_checkpoint(tmp_path):
    mgr = CheckpointManager(str(tmp_path), keep_last=0)
    _save_all(mgr, [(1, None), (2, None)])
    state = make_state(seed=7)
    info = CheckpointManager(str(tmp_path / "elsewhere")).load(state, uri=mgr.list()[0].uri)
    assert info.step == 1 and state.step == 1


def test_best_is_the_verified_checkpoint_with_the_best_metric_and_the_newer_wins_a_tie(tmp_path):
    from relaunch.components.core.contract.config import RelaunchConfig

    config = RelaunchConfig.model_validate({"store": {"uri": str(tmp_path)},
                                            "train": {"keep_last": 3, "keep_best": 0}})
    mgr = CheckpointManager.from_config(config, async_save=False)
    assert (mgr.keep_last, mgr.best_metric, mgr.mode) == (3, "val_loss", "min")
    _save_all(mgr, [(1, 0.3), (2, 0.2), (3, 0.2)])
    assert mgr.best().step == 3
    mgr.store.write_bytes(f"{step_key(3)}/__0_0.distcp", b"broken")
    assert mgr.best().step == 2
    assert mgr.best(mode="max").step == 1
