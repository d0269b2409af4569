"""The steps one by one, in-process against a real file store and a real MLflow (sqlite): prepare's
dataset reuse and run identity, the pipeline parameters it folds in, locate's choices, evaluate's gate,
and the local launcher's commands."""

from __future__ import annotations

import json

import pytest
import torch

from relaunch.components import evaluate, locate, prepare
from relaunch.components.core.checkpoint import CheckpointManager
from relaunch.components.core.contract.config import RelaunchConfig
from relaunch.components.core.contract.errors import BadInput
from relaunch.components.core.trainer.state import TrainingState
from relaunch.components.launchers.jobs import job_spec
from relaunch.components.launchers.local import build_commands
from relaunch.components.tasks.base import load_task


@pytest.fixture
def config(tmp_path) -> RelaunchConfig:
    return RelaunchConfig.model_validate({
        "store": {"uri": str(tmp_path / "store")},
        "tracking": {"uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "artifact_location": str(tmp_path / "art")},
        "train": {"hidden_size": 8},
    })


def test_prepare_reuses_the_dataset_version_and_the_run_of_the_same_pipeline_run(config):
    first = prepare.run(config, pipeline_run_id="p-1")
    again = prepare.run(config, pipeline_run_id="p-1")
    other = prepare.run(config, pipeline_run_id="p-2")
    assert first.dataset_version == again.dataset_version == other.dataset_version
    assert first.run_id == again.run_id != other.run_id
    resolved = RelaunchConfig.from_json(first.config_json)
    assert resolved.data.version == first.dataset_version and resolved.tracking.run_id == first.run_id


def test_prepare_of_a_resume_reopens_a_run_an_interrupted_pipeline_marked_killed(config):
    from relaunch.components.core.tracking.client import END_REASON_TAG, client, mark_run_finished, tracking_uri

    first = prepare.run(config)
    mark_run_finished(config, first.run_id, "KILLED", "interrupted: stopped by Ctrl-C at step 31")
    resumed = config.model_copy(update={"tracking": config.tracking.model_copy(update={"run_id": first.run_id})})
    assert prepare.run(resumed).run_id == first.run_id
    run = client(tracking_uri(config)).get_run(first.run_id)
    assert run.info.status == "RUNNING" and END_REASON_TAG not in run.data.tags


def test_finalize_sends_the_metric_points_a_training_left_unsent_and_empties_their_record(config):
    """A training that ended while the tracking server was away left its points in the store's pending
    record; the pipeline's finalize delivers them into the run before marking it finished."""
    from mlflow.tracking import MlflowClient

    from relaunch.components import finalize
    from relaunch.components.core.store import open_store, records
    from relaunch.components.core.tracking.client import tracking_uri

    run_id = prepare.run(config).run_id
    store = open_store(config.store.uri)
    points = [[step, {"train/loss": 1.0 / step}] for step in range(1, 6)]
    records.write_pending_metrics(store, 5, points, {"relaunch.tracking.lost_contact": "true"}, "FINISHED")
    done = config.model_copy(update={"tracking": config.tracking.model_copy(update={"run_id": run_id})})
    assert finalize.run(done).status == "FINISHED"
    client = MlflowClient(tracking_uri(config))
    assert sorted(m.step for m in client.get_metric_history(run_id, "train/loss")) == [1, 2, 3, 4, 5]
    assert client.get_run(run_id).data.tags["relaunch.tracking.lost_contact"] == "true"
    assert records.read_pending(store) == {"points": [], "tags": {}, "status": None}


def _save(config: RelaunchConfig, step: int, hidden: int | None = None) -> CheckpointManager:
    cfg = config if hidden is None else config.model_copy(update={"train": config.train.model_copy(update={"hidden_size": hidden})})
    mgr = CheckpointManager(cfg.store.uri, async_save=False)
    torch.manual_seed(step)
    mgr.save(step, TrainingState(load_task(cfg.train.task, cfg).build_model()), metrics={"val_loss": 1.0 / step})
    return mgr


def test_locate_finds_nothing_in_an_empty_store(config):
    assert locate.run(config) == locate.LocateOutputs(checkpoint_uri="", step=-1, source="none")


def test_locate_prefers_the_latest_checkpoint_of_this_training_over_resume_from(config, tmp_path):
    other = config.model_copy(update={"store": config.store.model_copy(update={"uri": str(tmp_path / "other")})})
    elsewhere = _save(other, 3).latest().uri
    with_resume = config.model_copy(update={"train": config.train.model_copy(update={"resume_from": elsewhere})})
    assert locate.run(with_resume) == locate.LocateOutputs(elsewhere, 3, "resume_from")
    _save(config, 5)
    found = locate.run(with_resume)
    assert (found.step, found.source) == (5, "latest")


def test_evaluate_gives_the_gate_verdict_on_the_latest_checkpoint(config):
    _save(config, 5)
    out = evaluate.run(config)
    metrics = json.loads(out.metrics_json)
    assert out.step == 5 and set(metrics) == {"accuracy", "loss"}
    assert out.passed == (metrics["accuracy"] >= config.evaluate.gate_min)
    strict = config.model_copy(update={"evaluate": config.evaluate.model_copy(update={"gate_min": 1.01})})
    assert evaluate.run(strict).passed is False


def test_evaluate_refuses_a_gate_metric_the_task_does_not_compute(config):
    _save(config, 5)
    odd = config.model_copy(update={"evaluate": config.evaluate.model_copy(update={"gate_metric": "f1"})})
    with pytest.raises(BadInput, match="'f1' is not computed"):
        evaluate.run(odd)


def test_evaluate_without_a_checkpoint_is_bad_input(config):
    with pytest.raises(BadInput, match="no committed checkpoint"):
        evaluate.run(config)


@pytest.mark.parametrize("nodes, procs, min_nodes, nnodes", [(2, 1, None, "2"), (3, 2, None, "3"), (4, 1, 2, "2:4")])
def test_the_local_launcher_starts_one_torchrun_agent_per_simulated_node(nodes, procs, min_nodes, nnodes):
    config = RelaunchConfig.model_validate({"launch": {"nodes": nodes, "procs_per_node": procs, "min_nodes": min_nodes}})
    commands = build_commands(job_spec(config), job_id="job-1", port=29555)
    assert len(commands) == nodes
    for node, cmd in enumerate(commands):
        assert f"--nnodes={nnodes}" in cmd and f"--nproc-per-node={procs}" in cmd
        assert "--rdzv-backend=c10d" in cmd and "--rdzv-endpoint=127.0.0.1:29555" in cmd
        assert f"--rdzv-conf=is_host={'true' if node == 0 else 'false'}" in cmd
        assert "--max-restarts=3" in cmd and cmd[-4:] == ["-m", "relaunch.components.train", "--config-json", config.to_json()]


@pytest.mark.parametrize("path", ["configs/local.yaml"])
def test_the_example_configs_are_valid(path):
    from pathlib import Path

    from relaunch.components.core.contract.config_loading import load_config

    root = Path(__file__).resolve().parents[2]
    assert load_config(root / path) == RelaunchConfig()  # local.yaml spells out the embedded defaults


def test_a_rank_0_that_failed_before_writing_its_exit_record_gives_the_launch_its_own_exit_code(tmp_path):
    """A bad input found at the trainer's set-up: no ``runs/exit.json`` yet, but rank 0's ``exit``
    event says exit 2, so the launch fails permanently instead of as a kill (137, retried)."""
    import io
    import time

    from relaunch.components.core.contract import events
    from relaunch.components.launchers.local import ProgressReporter, AgentWatch, _outcome

    def line(kind, **fields) -> str:  # as rank 0 prints it, behind torchrun's prefix
        out = io.StringIO()
        events.write(kind, out, **fields)
        return "[default0]:" + out.getvalue().rstrip("\n")

    config = RelaunchConfig.model_validate({"store": {"uri": str(tmp_path / "store")}})
    watch = AgentWatch(ProgressReporter(None))
    started = time.time()
    watch.handle(line(events.Kind.EXIT, exit_code=2, reason="train.global_batch_size=64 is not divisible"), 0)
    watch.handle("  exitcode  : 2 (pid: 1)", 1)
    assert _outcome(config, [1, 1], watch, started) == 2
    assert watch.failure_message(2) == "training ended with exit code 2: train.global_batch_size=64 is not divisible"
    watch.handle(line(events.Kind.RESUMED, attempt=2, step=-1), 0)  # a later attempt, killed without a word
    assert _outcome(config, [1, 1], watch, started) == 137
