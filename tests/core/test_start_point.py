"""start_point(): one rule of where a training starts, applied by the workers (locate reports it), and a
warm start that loads weights only;
the registry's answers are classified by MLflow's error code and HTTP status, never by message text."""

from __future__ import annotations

import contextlib

import pytest
import torch
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE, RESOURCE_DOES_NOT_EXIST, TEMPORARILY_UNAVAILABLE

from relaunch.components import locate
from relaunch.components.core.checkpoint import CheckpointManager, step_key
from relaunch.components.core.recovery.start import start, start_point
from relaunch.components.core.contract.config import RelaunchConfig
from relaunch.components.core.contract.errors import BadInput, TransientFailure
from relaunch.components.core.tracking.warm_start import warm_start_checkpoint
from relaunch.components.core.trainer.setup import ModelParts
from relaunch.components.core.trainer.state import ModelWeights
from relaunch.components.launchers.jobs import worker_config
from tests.core.helpers import make_state, train_steps


def _config(store: str, **train) -> RelaunchConfig:
    return RelaunchConfig.model_validate({"store": {"uri": store}, "train": train})


def _saved(root: str, step: int):
    state = make_state(seed=step)
    train_steps(state, 2)
    state.step = step
    with CheckpointManager(root, owner="start-test", async_save=False) as mgr:
        mgr.save(step, state)
        return state, mgr.wait()


def test_the_latest_checkpoint_wins_then_resume_from_then_the_warm_start_then_nothing(tmp_path):
    other = str(tmp_path / "other")
    _, elsewhere = _saved(other, 3)
    warm = lambda config: elsewhere.uri  # noqa: E731 - the registry's answer
    mine = str(tmp_path / "mine")
    cases = [({}, ("none", -1)), ({"resume_from": elsewhere.uri}, ("resume_from", 3)),
             ({"warm_start_model": "models:/m/1"}, ("warm_start", 3)),
             # what a pipeline hands launch after locate chose the warm start: still weights only
             ({"warm_start_model": "models:/m/1", "resume_from": elsewhere.uri}, ("warm_start", 3))]
    for train, (source, step) in cases:
        with CheckpointManager(mine, async_save=False) as mgr:
            start = start_point(_config(mine, **train), mgr, warm_start_lookup=warm)
        assert (start.source, start.step) == (source, step), train
        assert start.weights_only == (source == "warm_start")
    _saved(mine, 5)
    with CheckpointManager(mine, async_save=False) as mgr:
        start = start_point(_config(mine, resume_from=elsewhere.uri), mgr, warm_start_lookup=warm)
    assert (start.source, start.step) == ("latest", 5)


def test_a_warm_start_loads_the_weights_and_nothing_else(tmp_path):
    saved, info = _saved(str(tmp_path / "store"), 7)
    fresh = make_state(seed=99)
    with CheckpointManager(str(tmp_path / "store"), async_save=False) as mgr:
        mgr.load(ModelWeights(fresh.model), uri=info.uri)
    assert all(torch.equal(a, b) for a, b in zip(fresh.model.parameters(), saved.model.parameters()))
    assert fresh.step == 0 and fresh.optimizer.state_dict()["state"] == {}


class _Registry:
    """The MLflow client's side of a registry that answers with ``error``."""

    def __init__(self, error: Exception):
        self.error = error

    def get_model_version(self, name, version):
        raise self.error

    get_model_version_by_alias = get_model_version


@pytest.mark.parametrize("error, expected", [
    (MlflowException("Registered Model with name=m not found", error_code=RESOURCE_DOES_NOT_EXIST), BadInput),
    (MlflowException("Registered model alias champion not found.", error_code=INVALID_PARAMETER_VALUE), BadInput),
    # a 503 whose text happens to say "not found" is still the registry being away: retryable
    (MlflowException("upstream not found, try again", error_code=TEMPORARILY_UNAVAILABLE), TransientFailure),
    (ConnectionError("connection refused"), TransientFailure),
])
def test_the_registry_answer_is_classified_by_its_error_code(monkeypatch, tmp_path, error, expected):
    import relaunch.components.core.tracking.client as tracking

    monkeypatch.setattr(tracking, "client", lambda uri: _Registry(error))
    with pytest.raises(expected):
        warm_start_checkpoint(_config(str(tmp_path), warm_start_model="models:/m@champion"))


def _worker_restores(config: RelaunchConfig, seed: int):
    """What a (re)started worker does: its manager, the rule, the load (recovery.start.start, no memory tier)."""
    state = make_state(seed=seed)
    parts = ModelParts(state.model, state.model, state.optimizer, state.scheduler, state.scaler, state)
    with CheckpointManager(config.store.uri, owner="start-test", async_save=False) as mgr:
        return start(config, mgr, parts, contextlib.nullcontext).restored, state


def test_the_worker_starts_where_locate_reported_and_a_restart_within_the_launch_from_the_newer_commit(tmp_path):
    config = _config(str(tmp_path / "store"))
    _saved(config.store.uri, 3)
    reported = locate.run(config)
    worker = worker_config(config, reported.checkpoint_uri)  # what launch hands every worker
    restored, state = _worker_restores(worker, seed=1)
    assert (reported.source, reported.step) == ("latest", 3) and restored.step == reported.step == state.step
    # the workers commit step 5, then torchrun restarts the group inside the same launch: locate's answer
    # (step 3, still in the workers' configuration) is stale; the restarted workers resume from step 5
    _saved(config.store.uri, 5)
    restarted, state = _worker_restores(worker, seed=2)
    assert restarted.step == state.step == 5 and restarted.uri.endswith(step_key(5))
    assert locate.run(config).step == 5  # and what locate reports now is that same start
