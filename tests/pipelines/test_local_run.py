"""The whole pipeline on this machine (``relaunch run``: kfp.local, real torchrun, real MLflow), end to end:
the README's in-order demo (a plain run, a new training with a worker killed mid-training, a ``--resume``
of a finished training), each line of the README's table of more failures to try (preempt, a storage
outage, three nodes), a ``--resume`` that finishes a pipeline whose register failed, against real services
(an S3 server over HTTP, an ``mlflow server`` on Postgres), with a whole launch step failing and retried,
a last attempt killed with nothing after it, and permanent failures that must stop the pipeline at once."""

from __future__ import annotations

import io
import json
import re
import shlex
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from relaunch.pipelines.spec import STEP_TABLE
from relaunch.components.core.contract.config import RelaunchConfig
from relaunch.components.core.contract.exitcodes import RETRYABLE, ExitCode
from relaunch.components.core.store.ledger import load_attempts
from relaunch.components.core.store import open_store
from tests.cli import RUN_TIMEOUT, newest_training, relaunch_run

ROOT = Path(__file__).resolve().parents[2]
# the demo fixture runs three `relaunch run`s inside the first test that uses it
pytestmark = [pytest.mark.slow, pytest.mark.timeout(3 * RUN_TIMEOUT + 60)]


def events(cwd: Path) -> list[dict]:
    files = sorted((cwd / ".relaunch" / "runs").rglob("events.jsonl"))
    return [json.loads(line) for line in files[-1].read_text().splitlines()]


def summary_of(store_uri: str) -> dict:
    from relaunch.components.core.store.records import read_summary
    from relaunch.components.core.store import open_store

    return read_summary(open_store(store_uri))


def _readme() -> str:
    return (ROOT / "README.md").read_text()


def _make_run_args(line: str) -> list[str]:
    """``make run`` -> [], ``make run ARGS="..."`` -> its arguments."""
    found = re.match(r'make run(?: ARGS="([^"]*)")?(?:\s|$)', line)
    assert found, line
    return shlex.split(found.group(1) or "")


def readme_demo() -> list[list[str]]:
    """The README's in-order demo (the block after "runs them in this order"), as ``relaunch run`` arguments."""
    block = re.search(r"runs them in this order:\n\n```\n(.*?)```", _readme(), re.S)
    assert block, "the README lost its in-order demo"
    return [_make_run_args(line) for line in block.group(1).splitlines() if line.startswith("make run")]


def readme_tries() -> dict[str, list[str]]:
    """The README's table of more failures to try: the test named on each row -> that row's arguments."""
    rows = re.findall(r"^\| `(make run[^`]*)` \|[^|]*\| `(test_\w+)` \|$", _readme(), re.M)
    return {test: _make_run_args(line) for line, test in rows}


def readme_line(test: str) -> list[str]:
    """The arguments of the README row that names ``test``."""
    return readme_tries()[test]


# the tests the README's table names; each runs its row's line, read from the README by readme_line
PREEMPT = "test_a_preempted_training_checkpoints_exits_143_and_resumes"
OUTAGE = "test_a_storage_outage_on_s3_is_absorbed_and_the_pipeline_finishes"
THREE_NODES = "test_three_nodes_train_and_a_failed_launch_step_is_retried_and_resumes"


def test_each_row_of_the_readme_failures_table_names_a_test_here_that_runs_its_line():
    assert set(readme_tries()) == {PREEMPT, OUTAGE, THREE_NODES}
    assert all(callable(globals().get(name)) for name in (PREEMPT, OUTAGE, THREE_NODES))


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The README's in-order demo: ``make run``, then ``make run ARGS="--inject-failure kill-worker@step=30"``,
    then ``make run ARGS="--resume"``, in one directory (shortened trainings)."""
    lines = readme_demo()
    plain, kill, resume = lines[0], lines[1], lines[-1]
    assert (plain, kill, resume) == ([], ["--inject-failure", "kill-worker@step=30"], ["--resume"]), lines
    cwd = tmp_path_factory.mktemp("embedded")
    (cwd / "tmp").mkdir()
    tmp = {"TMPDIR": str(cwd / "tmp")}
    first = relaunch_run(cwd, "--set", "train.max_steps=40", *plain, env=tmp)
    first_training = newest_training(str(cwd / ".relaunch/store"))
    second = relaunch_run(cwd, "--set", "train.max_steps=40", *kill, env=tmp)
    again = relaunch_run(cwd, *resume, env=tmp)
    return cwd, first, first_training, second, again


@pytest.fixture(scope="module")
def embedded(demo):
    """The second demo line: a new training whose worker was killed at step 30."""
    cwd, _, _, second, _ = demo
    return cwd, second


def test_the_embedded_run_finishes_despite_the_killed_worker(embedded):
    cwd, out = embedded
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]


def test_every_step_of_a_relaunch_run_is_forked_from_a_warm_server(embedded):
    cwd, _ = embedded
    started = [e for e in events(cwd) if e["kind"] == "step-start"]
    assert {e["step"] for e in started} == set(STEP_TABLE)
    assert all(e["warm"] for e in started), started


def test_a_whole_pipeline_run_leaves_no_temp_directory_of_ours_behind(embedded):
    cwd, _ = embedded  # relaunch-ckpt-* (checkpoint manager), relaunch-goodput-* (trainer), relaunch-model-* (register)
    assert sorted(p.name for p in (cwd / "tmp").glob("relaunch-*")) == []


def in_place_recovery(cwd: Path) -> dict:
    """The one recovery of the worker killed at step 30 (the memory tier, on by default for two ranks):
    inside the first attempt, from the newest snapshot every rank could serve."""
    summary = summary_of(newest_training(str(cwd / ".relaunch/store")))
    assert summary["resumed_from_steps"] == [-1]  # one attempt: nothing started again
    (recovery,) = summary["goodput"]["in_place"]
    return recovery


def test_the_killed_worker_was_replaced_in_place_within_its_attempt_from_its_peers_memory_or_the_store(embedded):
    cwd, _ = embedded
    recovery = in_place_recovery(cwd)
    assert recovery["lost_at_step"] == 30 and 0 < recovery["resumed_step"] <= 30
    resumed = [e for e in events(cwd) if e["kind"] == "resumed"]
    assert [e["step"] for e in resumed] == [-1, recovery["resumed_step"]] and resumed[-1]["in_place"]
    # memory, unless the kill fell inside a snapshot's hand-over to its peer (then every rank read the store)
    assert (resumed[-1]["source"], resumed[-1]["store_bytes_read"] == 0) in (("memory", True), ("store", False))
    assert resumed[-1]["uri"] == (f"memory://step-{recovery['resumed_step']}" if resumed[-1]["source"] == "memory"
                                  else f"{newest_training(str(cwd / '.relaunch/store'))}/checkpoints/"
                                       f"step-{recovery['resumed_step']:012d}")


def test_the_embedded_run_keeps_its_data_under_dot_relaunch(embedded):
    cwd, _ = embedded
    assert (cwd / ".relaunch/mlflow.db").is_file()
    training = Path(newest_training(str(cwd / ".relaunch/store")))
    assert training.parent == cwd / ".relaunch/store/trainings"
    assert any((training / "datasets").iterdir())
    assert (training / "checkpoints/step-000000000040/MANIFEST.json").is_file()
    assert any((cwd / ".relaunch/mlartifacts").rglob("confusion_matrix_test.png"))


def _runs(cwd: Path) -> list:
    client = MlflowClient(f"sqlite:///{cwd}/.relaunch/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("relaunch").experiment_id], order_by=["start_time ASC"])
    return runs


def _artifact(tracking_uri: str, run, path: str, into: Path):
    """The JSON artifact ``path`` of ``run`` (``relaunch/attempts.json``, ``relaunch/checkpoints.json``)."""
    return json.loads(Path(MlflowClient(tracking_uri).download_artifacts(run.info.run_id, path, str(into))).read_text())


def test_each_relaunch_run_is_a_new_training_with_its_own_mlflow_run_and_both_finish(demo):
    cwd, first, first_training, second, _ = demo
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    plain, killed = _runs(cwd)
    assert plain.info.status == killed.info.status == "FINISHED"
    assert "eval_test_accuracy" in killed.data.metrics and killed.data.params["launch.nodes"] == "2"
    assert newest_training(str(cwd / ".relaunch/store")) != first_training
    assert plain.data.tags["relaunch.restarts"] == killed.data.tags["relaunch.restarts"] == "0"  # replaced in place
    assert summary_of(first_training)["resumed_from_steps"] == [-1]
    assert "0 in-place agent restart(s), 0 launch retries; no resume" in first.stdout
    assert "0 in-place agent restart(s), 1 worker(s) replaced in place, 0 launch retries\n" in second.stdout
    assert "recovered        in place from" in second.stdout and "recovered" not in first.stdout
    assert "relaunch-digits version 1" in first.stdout  # what the README's first demo line promises


def test_resuming_a_training_that_reached_its_end_says_so_in_one_line_and_trains_nothing(demo):
    cwd, _, _, _, again = demo
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert again.stdout.strip().count("\n") == 0 and "already reached its end" in again.stdout
    assert "relaunch run` starts a new training" in again.stdout
    assert len(list((cwd / ".relaunch" / "runs").rglob("events.jsonl"))) == 2  # no third pipeline ran
    assert len(_runs(cwd)) == 2


def test_the_in_place_recovery_is_recorded_on_the_run_inside_its_one_attempt(demo, tmp_path):
    cwd, _, _, second, _ = demo
    run = _runs(cwd)[1]
    tags = run.data.tags
    assert (tags["relaunch.attempts"], tags["relaunch.last_exit_code"]) == ("1", "0")
    (attempt,) = _artifact(f"sqlite:///{cwd}/.relaunch/mlflow.db", run, "relaunch/attempts.json", tmp_path)
    assert (attempt["resumed_from_step"], attempt["exit_code"], attempt["last_step"]) == (-1, 0, 40)
    goodput = _artifact(f"sqlite:///{cwd}/.relaunch/mlflow.db", run, "goodput/goodput.json", tmp_path)
    assert [(r["lost_at_step"], r["resumed_step"]) for r in goodput["in_place"]] == \
        [(30, in_place_recovery(cwd)["resumed_step"])]
    assert "recovered in place from" in second.stdout and "exit 137, retrying" not in second.stdout


def test_the_checkpoint_history_is_one_artifact_naming_existing_and_deleted_checkpoints(demo, tmp_path):
    cwd, *_ = demo
    training = Path(newest_training(str(cwd / ".relaunch/store")))
    run = _runs(cwd)[1]
    assert not [k for k in run.data.tags if k.startswith(("checkpoint.step-", "relaunch.attempt."))]
    history = _artifact(f"sqlite:///{cwd}/.relaunch/mlflow.db", run, "relaunch/checkpoints.json", tmp_path)
    deleted = [c for c in history if c["state"] == "deleted by retention"]
    assert deleted, "retention (keep_last=3) deleted some of the checkpoints of a 40-step run"
    for c in history:
        folder = training / "checkpoints" / f"step-{c['step']:012d}"
        assert folder.is_dir() != (c in deleted), c
        assert c["uri"].endswith(f"checkpoints/{folder.name}") and c["attempt"] == 1


def test_single_number_summaries_are_tags_and_a_goodput_figure_not_metric_series(demo):
    cwd, *_ = demo
    run = _runs(cwd)[1]
    assert not [k for k in run.data.metrics if k.startswith(("goodput/", "tracking/"))]
    assert 0 < float(run.data.tags["goodput.ettr"]) <= 1 and run.data.tags["goodput.attempts"] == "1"
    client = MlflowClient(f"sqlite:///{cwd}/.relaunch/mlflow.db")
    assert {a.path for a in client.list_artifacts(run.info.run_id, "goodput")} == {"goodput/goodput.png",
                                                                                  "goodput/goodput.json"}


def test_the_registered_versions_come_one_per_training_and_their_checkpoints_are_pinned(embedded):
    cwd, _ = embedded
    client = MlflowClient(f"sqlite:///{cwd}/.relaunch/mlflow.db")
    versions = sorted(client.search_model_versions("name = 'relaunch-digits'"), key=lambda v: int(v.version))
    assert len(versions) == 2
    assert "challenger" in client.get_model_version("relaunch-digits", versions[-1].version).aliases
    training = newest_training(str(cwd / ".relaunch/store"))
    assert versions[-1].tags["relaunch.checkpoint_uri"] == f"{training}/checkpoints/step-000000000040"
    assert list((Path(training) / "checkpoints/pins").iterdir())


def test_the_output_is_a_line_per_step_and_a_summary_with_the_recovery(embedded):
    cwd, out = embedded
    text = out.stdout
    for step in ("prepare", "locate-latest-checkpoint", "launch", "evaluate", "register", "finalize"):
        assert f"✓ {step}" in text
    for needle in ("MLflow run", "make ui", "checkpoints", "metrics", "relaunch-digits version 2",
                   "challenger", "ETTR", "in-place agent restart(s)",
                   f"resumed at step {in_place_recovery(cwd)['resumed_step']} in"):
        assert needle in text, needle
    assert "KFP Executor" not in text  # kfp.local's chatter went to the log file


# ---------------------------------------------------------------- the README's table of more failures


def pipeline_log(cwd: Path) -> str:
    return sorted((cwd / ".relaunch" / "runs").rglob("pipeline.log"))[-1].read_text()


@pytest.fixture(scope="module")
def preempted(tmp_path_factory):
    """The README's preempt line on a 40-step training whose register fails (a champion metric the
    evaluation does not report), then ``--resume``."""
    cwd = tmp_path_factory.mktemp("preempted")
    length = ("--set", "train.max_steps=40")
    failed = relaunch_run(cwd, *length, *readme_line(PREEMPT), "--set", "registry.champion_metric=acuracy")
    # the training's own configuration holds the typo: the resume names the fix (a key that may change)
    finished = relaunch_run(cwd, "--resume", "--set", "registry.champion_metric=accuracy")
    return cwd, failed, finished


def test_a_preempted_training_checkpoints_exits_143_and_resumes(preempted, tmp_path):
    cwd, failed, _ = preempted
    run = _runs(cwd)[0]
    first, again = _artifact(f"sqlite:///{cwd}/.relaunch/mlflow.db", run, "relaunch/attempts.json", tmp_path)
    assert (first["exit_code"], again["exit_code"]) == (143, 0)
    stopped_at = first["last_step"]
    assert stopped_at >= 30 and again["resumed_from_step"] == stopped_at  # nothing recomputed
    # what the README's preempt row promises, on the terminal
    assert f"checkpoint at step {stopped_at} committed -> exit 143, retrying" in failed.stdout, failed.stdout[-3000:]
    assert summary_of(newest_training(str(cwd / ".relaunch/store")))["resumed_from_steps"] == [-1, stopped_at]
    assert "1 in-place agent restart(s), 0 launch retries" in failed.stdout, failed.stdout[-3000:]


def test_resume_after_a_failed_register_finishes_the_pipeline_in_the_same_run_without_training(preempted):
    cwd, failed, finished = preempted
    assert failed.returncode == 2 and "register failed (exit 2)" in failed.stderr, failed.stderr[-3000:]
    assert "registry.champion_metric: 'acuracy'" in failed.stderr
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    assert "reached its end (step 40 of 40) but its pipeline did not finish" in finished.stdout
    assert "nothing to launch" in pipeline_log(cwd)
    assert not [e for e in events(cwd) if e["kind"] in ("resumed", "progress")]  # the resume trained nothing
    (run,) = _runs(cwd)
    tags = run.data.tags
    assert run.info.status == "FINISHED" and "relaunch.end_reason" not in tags
    assert (tags["relaunch.attempts"], tags["relaunch.restarts"], tags["goodput.attempts"]) == ("2", "1", "2")
    assert "Outcome: FINISHED" in tags["mlflow.note.content"]
    client = MlflowClient(f"sqlite:///{cwd}/.relaunch/mlflow.db")
    (version,) = client.search_model_versions("name = 'relaunch-digits'")
    training = newest_training(str(cwd / ".relaunch/store"))
    assert version.run_id == run.info.run_id
    assert version.tags["relaunch.checkpoint_uri"] == f"{training}/checkpoints/step-000000000040"
    for needle in ("relaunch-digits version 1", "1 in-place agent restart(s)", f"runs/{run.info.run_id}?workflowType"):
        assert needle in finished.stdout, needle


def test_a_storage_outage_on_s3_is_absorbed_and_the_pipeline_finishes(tmp_path, s3_env, mlflow_server):
    """The README's storage-outage line against real services: an S3 server over HTTP and an
    ``mlflow server`` on Postgres."""
    s3_env.create_bucket("relaunch-e2e")
    out = relaunch_run(tmp_path, "--set", "train.max_steps=40", *readme_line(OUTAGE),
                       "--set", "store.uri=s3://relaunch-e2e/run", "--set", f"tracking.uri={mlflow_server.uri}",
                       "--set", "registry.model_name=e2e-digits", "--set", "evaluate.gate_min=0.1")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "inject storage-outage: the store fails for 3 s" in pipeline_log(tmp_path)
    assert "0 in-place agent restart(s), 0 launch retries" in out.stdout
    training = newest_training("s3://relaunch-e2e/run")
    assert summary_of(training)["last_committed_step"] == 40
    client = MlflowClient(mlflow_server.uri)
    (version,) = client.search_model_versions("name = 'e2e-digits'")
    assert version.tags["relaunch.checkpoint_uri"] == f"{training}/checkpoints/step-000000000040"
    assert client.get_run(version.run_id).info.status == "FINISHED"
    assert not (tmp_path / ".relaunch/store").exists() and not (tmp_path / ".relaunch/mlflow.db").exists()


# ---------------------------------------------------------------- a whole launch step retried

def test_three_nodes_train_and_a_failed_launch_step_is_retried_and_resumes(tmp_path):
    # synchronous saves: step 10 is committed before step 11 starts, however loaded the machine is
    out = relaunch_run(tmp_path, "--set", "train.max_steps=30", *readme_line(THREE_NODES),
                       "--set", "launch.max_restarts=0", "--set", "train.async_save=false",
                       "--inject-failure", "kill-worker@step=15")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    evs = events(tmp_path)
    (retry,) = [e for e in evs if e["kind"] == "retry"]
    # the killed worker's peers report 138 ("a peer rank failed") or the kill itself shows as 137: both retryable
    assert retry["step"] == "launch" and retry["exit_code"] in RETRYABLE and retry["delay"] == 10
    assert [e["step"] for e in evs if e["kind"] == "step-start"].count("launch") == 2
    training = newest_training(str(tmp_path / ".relaunch/store"))
    assert summary_of(training)["resumed_from_steps"][-1] == 10
    assert [a.world_size for a in load_attempts(open_store(training))] == [3, 3]
    assert "↻ launch" in out.stdout and "1 launch retry" in out.stdout


# ---------------------------------------------------------------- a last attempt killed, nothing after it

def test_a_last_attempt_killed_with_no_attempt_after_it_is_recorded_by_finalize(tmp_path, monkeypatch):
    """One node, one process, no restarts: the killed rank is rank 0, so no trainer is left to tag its
    attempt; the launch step fails (run by hand here: no pipeline retry follows) and finalize records it."""
    from relaunch.components import finalize, launch, prepare

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("RELAUNCH_EVENTS", raising=False)
    config = RelaunchConfig.model_validate({
        "store": {"uri": str(tmp_path / "store")}, "tracking": {"uri": f"sqlite:///{tmp_path}/mlflow.db"},
        "train": {"max_steps": 20, "hidden_size": 32, "checkpoint_every_steps": 2},
        "launch": {"nodes": 1, "procs_per_node": 1, "max_restarts": 0, "rdzv_port": 0,
                   "inject_failure": "kill-worker@step=7"}})
    resolved = RelaunchConfig.from_json(prepare.run(config, pipeline_run_id="by-hand").config_json)
    with pytest.raises(launch.LaunchFailed) as failed:
        launch.run(resolved, pipeline_run_id="by-hand")
    assert failed.value.exit_code == ExitCode.KILLED
    finalize.run(config, pipeline_run_id="by-hand", state="FAILED", error=str(failed.value))
    run = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").get_run(resolved.tracking.run_id)
    tags = run.data.tags
    assert run.info.status == "FAILED"
    (first,) = _artifact(f"sqlite:///{tmp_path}/mlflow.db", run, "relaunch/attempts.json", tmp_path / "artifacts")
    assert (first["exit_code"], first["resumed_from_step"], first["end_recorded"]) == (137, -1, False)
    assert 0 <= first["last_step"] < 7 and first["start"] <= first["end"]
    assert (tags["relaunch.attempts"], tags["relaunch.restarts"], tags["relaunch.last_exit_code"]) == ("1", "0", "137")
    history = _artifact(f"sqlite:///{tmp_path}/mlflow.db", run, "relaunch/checkpoints.json", tmp_path / "artifacts")
    assert history and all(c["attempt"] == 1 and c["step"] < 7 for c in history)  # its commits, though it sent nothing


# ---------------------------------------------------------------- permanent failures stop at once

def _run_in_process(tmp_path, monkeypatch, cold=False, **overrides):
    from rich.console import Console

    from relaunch.pipelines.local.runner import run_pipeline

    monkeypatch.chdir(tmp_path)
    config = RelaunchConfig.model_validate(overrides)
    return run_pipeline(config, console=Console(file=io.StringIO()), state_dir=tmp_path / ".relaunch", cold=cold)


def test_a_bad_task_path_is_not_retried_and_stops_the_pipeline_with_exit_2(tmp_path, monkeypatch):
    result = _run_in_process(tmp_path, monkeypatch, train={"task": "no.such.module:make_task"})
    assert result.exit_code == 2 and result.failed_step == "prepare"
    assert "train.task: cannot import module 'no.such.module'" in result.message
    assert result.steps["prepare"].attempts == 1
    assert [s for s, r in result.steps.items() if r.attempts] == ["prepare", "finalize"]


def test_a_foreign_checkpoint_to_resume_from_stops_the_pipeline_at_locate(tmp_path, monkeypatch):
    import torch

    from relaunch.components.core.checkpoint import CheckpointManager
    from relaunch.components.core.trainer.state import TrainingState
    from relaunch.components.tasks.base import load_task

    other = RelaunchConfig.model_validate({"train": {"hidden_size": 3}})
    torch.manual_seed(0)
    CheckpointManager(str(tmp_path / "other"), async_save=False).save(
        4, TrainingState(load_task(other.train.task, other).build_model()))
    result = _run_in_process(tmp_path, monkeypatch, cold=True,  # the cold path: each step a fresh interpreter
                             train={"resume_from": str(tmp_path / "other/checkpoints/step-000000000004")})
    started = [json.loads(line) for line in (result.run_dir / "events.jsonl").read_text().splitlines()]
    assert [e["warm"] for e in started if e["kind"] == "step-start"] == [False, False, False]
    assert result.exit_code == 2 and result.failed_step == "locate-latest-checkpoint"
    assert "holds another model" in result.message
    assert result.steps["locate-latest-checkpoint"].attempts == 1 and result.steps["launch"].attempts == 0
    client = MlflowClient(f"sqlite:///{tmp_path}/.relaunch/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("relaunch").experiment_id])
    assert run.info.status == "FAILED"  # the exit handler closed the run
