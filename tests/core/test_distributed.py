"""The distributed environment (components/core/runtime/distributed.py)."""

from __future__ import annotations

import pytest

from relaunch.components.core.runtime.distributed import read_env
from relaunch.components.core.contract.errors import BadInput


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
