"""``launch.backend: ray`` with the language model (components/tasks/lm.py): its committed shards streamed by loader
worker processes inside each rank actor's trainer; the Ray worker of a rank SIGKILLed mid-epoch, after a checkpoint,
and the training resumed bitwise equal to an uninterrupted Ray run."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from relaunch.components.core.contract.config import RelaunchConfig
from relaunch.components.launchers import ray as ray_backend
from tests.launchers.test_ray_backend import kill_a_ray_worker_at, ray_config, trainers
from tests.train.test_streamed_data import TINY_LM, _assert_bitwise_equal, _final_state
from tests.needs import needed

needed("ray", "launch.backend=ray needs the extra: pip install -e '.[ray]' (make test installs it)")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

LM = {**TINY_LM, "max_steps": 20, "checkpoint_every_steps": 10}  # one checkpoint before the kill, one at the end


def lm_ray_config(tmp_path: Path, tracking: str, **train) -> RelaunchConfig:
    config = ray_config(tmp_path, tracking, **LM, **train).model_dump()
    config["data"]["num_workers"] = 2
    return RelaunchConfig.model_validate(config)


def watch_loader_workers(config: RelaunchConfig, seen: dict) -> threading.Thread:
    """Until the kill: the last rank's loader worker processes and the Ray worker hosting that rank's trainer."""
    def watch() -> None:
        last = config.launch.world_size - 1
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and "actor" not in seen:
            ranks = {pid: (parent, rank) for pid, parent, rank in trainers(config.store.uri)}
            workers = [pid for pid, parent, _ in trainers(config.store.uri, loader_workers=True)
                       if ranks.get(parent, (0, -1))[1] == last]
            actor = next((parent for parent, rank in ranks.values() if rank == last), None)
            if workers and actor:
                seen.update(actor=actor, workers=workers,
                            actor_cmdline=Path(f"/proc/{actor}/cmdline").read_bytes().decode(errors="replace"))
            time.sleep(0.2)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


# two Ray launches (1-3 min on 2 cores); make test proves the torchrun path: tests/train/test_streamed_data.py::
# test_the_language_model_killed_mid_epoch_resumes_from_its_shards_bitwise_equal[ddp]; .ci/run's extended lane
@pytest.mark.ci_extended
def test_the_language_model_resumes_bitwise_equal_after_a_ray_worker_with_loader_workers_is_sigkilled_mid_epoch(
        tmp_path, mlflow_server):
    plain = lm_ray_config(tmp_path / "plain", mlflow_server.uri)
    killed_config = lm_ray_config(tmp_path / "killed", mlflow_server.uri, step_sleep_seconds=0.1)
    reference = ray_backend.launch(plain, pipeline_run_id="plain", resume_from=None)
    assert reference.exit_code == 0, reference.message

    killed: list[int] = []
    seen: dict = {}
    watcher = watch_loader_workers(killed_config, seen)
    killer = kill_a_ray_worker_at(killed_config, 10, killed)
    restarted = ray_backend.launch(killed_config, pipeline_run_id="killed", resume_from=None)
    killer.join(1)
    watcher.join(1)

    assert seen.get("workers") and seen["actor_cmdline"].startswith("ray::RankActor"), seen
    assert killed == [seen["actor"]], (killed, seen)  # the Ray worker, not the trainer or a loader worker
    assert restarted.exit_code == 0 and restarted.restarts == 1, restarted
    assert restarted.resumed_from_steps[-1] == 10, restarted
    _assert_bitwise_equal(_final_state(plain.model_dump()), _final_state(killed_config.model_dump()))
    assert not trainers(killed_config.store.uri) and not trainers(killed_config.store.uri, loader_workers=True)
