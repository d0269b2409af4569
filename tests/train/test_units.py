"""The training's building blocks without torchrun: datasets, task loading, goodput, exit mapping,
health, the distributed environment, and the MLflow logger's exactly-once points (real server)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from components.core import goodput
from components.core.config import RelaunchConfig
from components.core.datasets import dataset_version, read_dataset, write_dataset
from components.core.distributed import read_env
from components.core.errors import BadInput, CorruptCheckpoint
from components.core.health import SpikeDetector
from components.core.storage import open_store
from components.tasks.base import load_task
from components.tasks.digits import digits_splits, load_digits_arrays


def test_dataset_versions_are_content_addressed_written_once_and_read_back_equal(tmp_path):
    store = open_store(str(tmp_path))
    splits = digits_splits(0.15, 0.15, 0)
    version = write_dataset(store, splits)
    assert version == dataset_version(splits) == write_dataset(store, splits)
    assert version != dataset_version(digits_splits(0.15, 0.15, 1))
    back = read_dataset(store, version)
    assert all(np.array_equal(back[s][k], splits[s][k]) for s in splits for k in splits[s])


def test_a_tampered_dataset_file_is_refused_and_an_unknown_version_is_bad_input(tmp_path):
    store = open_store(str(tmp_path))
    version = write_dataset(store, {"train": {"x": np.arange(6, dtype=np.float32), "y": np.arange(6)}})
    with pytest.raises(BadInput, match="not in the store"):
        read_dataset(store, "sha256-0000000000000000")
    store.write_bytes(f"datasets/{version}/splits.npz", b"not an npz")
    with pytest.raises(CorruptCheckpoint, match="sha256"):
        read_dataset(store, version)


def test_the_digits_task_reads_exactly_what_sklearn_load_digits_returns():
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    ours_x, ours_y = load_digits_arrays()
    assert np.array_equal(x, ours_x) and np.array_equal(y, ours_y)
    splits = digits_splits(0.15, 0.15, 0)
    assert sum(len(s["y"]) for s in splits.values()) == len(y)


@pytest.mark.parametrize("spec,words", [
    ("no_colon", "package.module:factory"),
    ("no.such.module:make", "cannot import module"),
    ("components.tasks.digits:nope", "no callable 'nope'"),
    ("components.core.config:RelaunchConfig", "cannot be called as factory"),
    ("components.core.errors:BadInput", "without build_splits"),
])
def test_load_task_refuses_a_bad_spec_with_one_line_naming_it(spec, words):
    with pytest.raises(BadInput, match=words):
        load_task(spec, RelaunchConfig())


def _attempt(n, start, loop, last_step, seen, resumed=-1, commits=None, end=None, stall=0.0):
    return goodput.Attempt(attempt=n, start=start, loop_start=loop, first_step_time=loop + 0.1, last_step=last_step,
                           last_seen=seen, resumed_from_step=resumed, commits=commits or {}, end=end,
                           stall_seconds=stall)


def test_goodput_report_splits_the_wall_time_into_productive_startup_stall_recomputed_and_gaps():
    first = _attempt(1, 0.0, 2.0, 50, 12.0, commits={"40": [10.0, 0.5]}, stall=0.5)  # killed at 12 s
    second = _attempt(2, 14.0, 15.0, 100, 25.0, resumed=40, end=25.0, stall=0.5)
    report = goodput.goodput_report([first, second])
    assert report["wall"] == 25.0
    assert report["startup"] == pytest.approx(3.0)       # 2 s + 1 s
    assert report["restart_gaps"] == pytest.approx(2.0)  # 12 -> 14
    assert report["recomputed"] == pytest.approx(2.0)    # steps 40..50 done again: 10 s -> 12 s
    assert report["checkpoint_stall"] == pytest.approx(1.0)
    assert report["productive"] == pytest.approx(17.0)
    assert report["ettr"] == pytest.approx(17.0 / 25.0)


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
        store.write_bytes(goodput.EXIT_KEY, json.dumps(record).encode())
    assert goodput.mapped_exit_code(store, rc, started_at=5.0) == expected


def test_spike_detector_counts_spikes_without_letting_them_raise_the_mean():
    spikes = SpikeDetector(factor=3.0, warmup_steps=2)
    flagged = [spikes.update(v) for v in [1.0, 1.0, 1.0, 10.0, 10.0, 1.0]]
    assert flagged == [False, False, False, True, True, False] and spikes.spikes == 2
    restored = SpikeDetector(factor=3.0)
    restored.load_state_dict(spikes.state_dict())
    assert (restored.mean, restored.spikes) == (spikes.mean, 2)


def test_the_distributed_environment_comes_from_torchrun_and_training_operator_variables(monkeypatch):
    for key, value in {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                       "GROUP_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400",
                       "TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_RUN_ID": "job"}.items():
        monkeypatch.setenv(key, value)
    env = read_env()
    assert (env.rank, env.world_size, env.local_rank, env.node_rank, env.nodes) == (3, 4, 1, 1, 2)
    assert (env.master_addr, env.master_port, env.restart_count, env.elastic_run_id) == ("10.0.0.1", 29400, 2, "job")
    monkeypatch.setenv("RANK", "7")
    with pytest.raises(BadInput, match="outside WORLD_SIZE"):
        read_env()


@pytest.mark.slow
def test_a_restarted_logger_never_logs_a_step_the_server_already_has(mlflow_server):
    from mlflow.tracking import MlflowClient

    from components.core.tracking import RunLogger, ensure_run, mark_run_finished

    config = RelaunchConfig.model_validate({"tracking": {"uri": mlflow_server.uri, "experiment": "logger-units"}})
    run_id = ensure_run(config, pipeline_run_id="units-1")
    assert ensure_run(config, pipeline_run_id="units-1") == run_id
    first = RunLogger(mlflow_server.uri, run_id)
    for step in range(1, 11):
        first.log_metrics({"train/loss": 1.0 / step}, step)
    assert first.close(30)
    second = RunLogger(mlflow_server.uri, run_id)  # a resumed attempt recomputes steps 6..10
    for step in range(6, 16):
        second.log_metrics({"train/loss": 1.0 / step}, step)
    assert second.close(30)
    steps = [m.step for m in MlflowClient(mlflow_server.uri).get_metric_history(run_id, "train/loss")]
    assert sorted(steps) == list(range(1, 16)) and second.stats.points_skipped_as_logged == 5
    mark_run_finished(config, run_id, "KILLED", reason="test")
    assert MlflowClient(mlflow_server.uri).get_run(run_id).info.status == "KILLED"


def test_an_unreachable_tracking_server_whose_url_contains_403_is_not_a_credentials_error(monkeypatch):
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import PERMISSION_DENIED, UNAUTHENTICATED
    from mlflow.tracking import MlflowClient

    from components.core.tracking import _is_auth_error

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    with pytest.raises(Exception) as unreachable:  # nothing listens on port 1403
        MlflowClient("http://127.0.0.1:1403").get_run("run403")
    assert "1403" in str(unreachable.value) and not _is_auth_error(unreachable.value)
    for code in (UNAUTHENTICATED, PERMISSION_DENIED):
        assert _is_auth_error(MlflowException("API request failed", error_code=code))
    assert _is_auth_error(MlflowException("API request to endpoint /x failed with error code 401 != 200"))
