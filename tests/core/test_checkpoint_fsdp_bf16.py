"""FSDP2 with bf16 mixed precision, one rank, no torchrun (a plain subprocess with a world of one): the
forward computes in bf16 while the checkpoint holds the fp32 shards and the fp32 optimizer state, and
a fresh bf16 model resumes from it with the same values."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = """
import json, torch, torch.distributed as dist
from relaunch.components.core.checkpoint import CheckpointManager
from relaunch.components.core.trainer.parallel import wrap_model
from relaunch.components.core.trainer.state import TrainingState

dist.init_process_group("gloo", init_method="file://{pg}", rank=0, world_size=1)

def build(seed):
    torch.manual_seed(seed)
    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    model = wrap_model(module, parallelism="fsdp", device=torch.device("cpu"), mixed_precision="bf16")
    return model, TrainingState(model, torch.optim.AdamW(model.parameters(), lr=0.01))

model, state = build(1)
out = model(torch.randn(4, 8))
out.float().pow(2).mean().backward()
state.optimizer.step()
state.step = 1
with CheckpointManager("{store}", async_save=False, owner="bf16") as mgr:
    mgr.save(1, state)
fresh_model, fresh = build(2)
with CheckpointManager("{store}", async_save=False, owner="bf16") as mgr:
    info = mgr.load(fresh)

def local(t):
    return t.to_local() if hasattr(t, "to_local") else t

params = [(local(a), local(b)) for a, b in zip(model.parameters(), fresh_model.parameters())]
moments = [(local(state.optimizer.state[a][k]), local(fresh.optimizer.state[b][k]))
           for a, b in zip(model.parameters(), fresh_model.parameters()) for k in ("exp_avg", "exp_avg_sq")]
print(json.dumps({{
    "forward_dtype": str(out.dtype),
    "param_dtypes": sorted({{str(a.dtype) for a, _ in params}}),
    "loaded_step": info.step, "step": fresh.step,
    "params_equal": all(torch.equal(a, b) for a, b in params),
    "moments_equal": all(torch.equal(a, b) for a, b in moments),
}}))
dist.destroy_process_group()
"""


def test_fsdp_bf16_mixed_precision_computes_in_bf16_and_resumes_its_fp32_state(tmp_path):
    script = _SCRIPT.format(pg=tmp_path / "pg", store=tmp_path / "store")
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=180,
                          env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"forward_dtype": "torch.bfloat16", "param_dtypes": ["torch.float32"], "loaded_step": 1,
                      "step": 1, "params_equal": True, "moments_equal": True}
