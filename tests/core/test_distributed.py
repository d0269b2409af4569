"""The distributed environment (components/core/runtime/distributed.py)."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from relaunch.components.core.contract.errors import BadInput
from relaunch.components.core.runtime.distributed import read_env
from relaunch.components.core.runtime.generations import GENERATION_ENV, joined_key
from relaunch.components.core.runtime.net import free_port


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


def test_an_in_place_worker_marks_its_generation_joined_before_it_waits_in_the_rendezvous():
    """The in-place agent replaces a lost rank within its generation only when the rank never entered that
    generation's rendezvous: the worker's mark must be there even when the rendezvous never completes."""
    port = free_port()
    agent_store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                                timeout=datetime.timedelta(seconds=30))
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True",
           "TORCHELASTIC_RESTART_COUNT": "3", GENERATION_ENV: "3",
           "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    script = ("from relaunch.components.core.runtime import distributed as d\n"
              "d.init(d.read_env(), 2.0)\n")  # rank 1 never comes: the rendezvous times out
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "rendezvous failed" in proc.stderr, proc.stderr[-2000:]
    assert agent_store.check([joined_key(3, 0)])
    assert not agent_store.check([joined_key(3, 1)])
