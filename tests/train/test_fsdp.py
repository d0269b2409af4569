"""Training with ``train.parallelism=fsdp`` through the real entrypoint (torchrun, gloo, CPU): a
killed worker resumes from its sharded checkpoint and ends bitwise equal to an uninterrupted FSDP
run; the sharded checkpoint loads into an unsharded model; a model FSDP cannot shard is bad input."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.train.conftest import ROOT, final_params, run_torchrun, train_config

pytestmark = pytest.mark.slow


@pytest.mark.ci_lane  # bitwise FSDP resume: test_checkpoint_sharded's, through wrap_model; the trainer's: test_resume
def test_an_fsdp_training_killed_mid_run_resumes_bitwise_equal_to_an_uninterrupted_one(tmp_path, tracking):
    plain = train_config(tmp_path / "plain", tracking, parallelism="fsdp")
    killed = train_config(tmp_path / "killed", tracking, parallelism="fsdp")
    killed["launch"] = {"inject_failure": "kill-worker@step=25"}
    reference = run_torchrun(plain, tmp_path, name="plain")
    restarted = run_torchrun(killed, tmp_path, name="killed", max_restarts=2)
    assert reference.proc.returncode == 0, reference.output()[-3000:]
    assert restarted.proc.returncode == 0, restarted.output()[-3000:]
    summary = restarted.records("SUMMARY")[-1]
    assert summary["attempts"] == 2 and 0 < summary["resumed_from_steps"][1] < 25, summary
    a, b = final_params(plain["store"]["uri"]), final_params(killed["store"]["uri"])  # FSDP -> one plain model
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


_UNSHARDABLE = """
import torch, torch.distributed as dist
from relaunch.components.core.contract.errors import BadInput
from relaunch.components.core.trainer.parallel import wrap_model
dist.init_process_group("gloo", init_method="file://{path}", rank=0, world_size=1)
try:
    wrap_model(torch.nn.Sequential(torch.nn.Tanh()), parallelism="fsdp", device=torch.device("cpu"))
except BadInput as err:
    print("BadInput:", err)
"""


def test_fsdp_for_a_model_without_parameters_is_one_line_of_bad_input(tmp_path):
    proc = subprocess.run([sys.executable, "-c", _UNSHARDABLE.format(path=tmp_path / "pg")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert "BadInput: train.parallelism=fsdp: the model Sequential has no trainable parameters" in proc.stdout, \
        proc.stdout + proc.stderr[-2000:]
