"""The Slurm path: the rendered sbatch script, and its SIGUSR1 -> agreed save -> requeue -> resume
cycle, run for real with bash and torchrun (``srun`` and ``scontrol`` are small stand-ins: no Slurm here)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from relaunch.components.core.contract.config import RelaunchConfig
from relaunch.components.launchers.slurm import render_sbatch
from tests.services import free_port
from tests.train.conftest import ROOT, Torchrun, train_config

FAKE_SRUN = """#!/bin/bash
# srun stand-in: drop srun's own options, run the task on this machine (srun would forward signals to it)
while [[ "$1" == --* ]]; do shift; done
exec "$@"
"""
FAKE_SCONTROL = """#!/bin/bash
# scontrol stand-in: `show hostnames` names this machine, `requeue` is recorded
case "$1" in
  show) echo 127.0.0.1 ;;
  requeue) echo "requeue $2" >> "$FAKE_SLURM_LOG" ;;
esac
"""


def test_the_rendered_sbatch_script_requeues_forwards_usr1_and_runs_srun_torchrun_on_the_first_node():
    config = RelaunchConfig.model_validate({"store": {"uri": "s3://bucket/exp"}, "launch": {"nodes": 4, "procs_per_node": 8},
                                            "train": {"preempt_grace_seconds": 55}})
    text = render_sbatch(config)
    for expected in ["#SBATCH --nodes=4", "#SBATCH --requeue", "#SBATCH --signal=B:USR1@60", "trap forward_usr1 USR1",
                     "srun --kill-on-bad-exit=0", "torchrun --nnodes=", "--nproc-per-node=8",
                     'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
                     '--rdzv-endpoint="$head_node:$rdzv_port"', "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
                     "-m relaunch.components.train --config-json", "s3://bucket/exp", 'scontrol requeue "$SLURM_JOB_ID"']:
        assert expected in text, expected
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0


def _start_job(script: Path, fake_bin: Path, log: Path, tmp_path: Path) -> Torchrun:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_TRACKING_URI", "RELAUNCH_"))}
    env.update({"PATH": f"{fake_bin}:{Path(sys.executable).parent}:{env['PATH']}", "PYTHONPATH": str(ROOT),
                "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node-a", "SLURM_NNODES": "1",
                "RELAUNCH_RDZV_PORT": str(free_port()), "FAKE_SLURM_LOG": str(tmp_path / "slurm.log")})
    proc = subprocess.Popen(["bash", str(script)], cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    return Torchrun(proc, log)


@pytest.mark.slow
def test_sigusr1_to_the_batch_shell_saves_exits_143_requeues_and_the_requeued_job_resumes(tmp_path, tracking):
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    for name, body in [("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)]:
        (fake_bin / name).write_text(body)
        (fake_bin / name).chmod(0o755)
    data = train_config(tmp_path, tracking, max_steps=100, step_sleep_seconds=0.03, checkpoint_every_steps=1000,
                        checkpoint_at_epoch_end=False)
    data["launch"] = {"nodes": 1, "procs_per_node": 2, "max_restarts": 0, "monitor_interval_seconds": 0.2}
    script = tmp_path / "job.sbatch"
    script.write_text(render_sbatch(RelaunchConfig.model_validate(data)))

    job = _start_job(script, fake_bin, tmp_path / "first.log", tmp_path)
    job.wait_for("PROGRESS", lambda r: r["step"] >= 30)
    os.kill(job.proc.pid, signal.SIGUSR1)  # what --signal=B:USR1@grace does before the time limit
    assert job.wait() == 143, job.output()[-3000:]
    summary = job.records("SUMMARY")[-1]
    assert summary["exit_code"] == 143 and summary["last_committed_step"] == summary["last_step"] >= 30
    assert "preempted by SIGUSR1" in job.output()
    assert (tmp_path / "slurm.log").read_text().splitlines() == ["requeue 4242"]

    requeued = _start_job(script, fake_bin, tmp_path / "second.log", tmp_path)
    assert requeued.wait() == 0, requeued.output()[-3000:]
    assert requeued.records("RESUMED")[0]["step"] == summary["last_committed_step"]
    assert requeued.records("SUMMARY")[-1]["last_committed_step"] == 100
    assert (tmp_path / "slurm.log").read_text().splitlines() == ["requeue 4242"], "no requeue after success"
