"""The Slurm path: an sbatch script that runs the same entrypoint under ``srun torchrun``.

    relaunch render slurm -o job.sbatch --set launch.nodes=4 --set store.uri=s3://bucket/exp
    sbatch job.sbatch

What the script does: one ``srun`` task per node starts ``torchrun`` with the c10d rendezvous on the
job's first node; ``--signal=B:USR1@<grace>`` makes Slurm send SIGUSR1 to the batch shell that long
before the time limit; the shell forwards it to ``srun`` (which forwards signals to its tasks), and
torchrun, told to handle SIGUSR1, passes it to the workers: they agree on a save at the next step
boundary and exit 143. The script then maps torchrun's exit status to the contract's code
(``python -m relaunch.components.launchers.torchrun --map-exit``) and, when it is retryable, requeues the job
(``scontrol requeue``; ``--requeue`` also lets Slurm requeue it after a node failure). The requeued
job keeps its id, hence its writer identity, and resumes from the latest committed checkpoint.

Credentials are not in the script: the store's ``AWS_*`` and MLflow's ``MLFLOW_TRACKING_*`` come from
the submitting environment (``sbatch`` exports it by default) or a sourced file named in
``RELAUNCH_ENV_FILE``.
"""

from __future__ import annotations

import shlex

from ..core.contract.config import RelaunchConfig
from ..core.contract.errors import BadInput
from .jobs import JobSpec, job_spec

TORCHRUN_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


def render_sbatch(config: RelaunchConfig, *, python: str = "python", rdzv_port: int = 29500) -> str:
    """The sbatch script for ``config``: its :func:`~relaunch.components.launchers.jobs.job_spec`, rendered
    by :func:`render_spec` (side-effect free: build, then the caller writes it)."""
    return render_spec(job_spec(config), python=python, rdzv_port=rdzv_port)


def render_spec(spec: JobSpec, *, python: str = "python", rdzv_port: int = 29500) -> str:
    """The sbatch script that runs ``spec``."""
    grace = max(10, int(spec.grace_seconds) + 5)
    gpus = f"#SBATCH --gpus-per-node={spec.resources.gpus}\n" if spec.resources.gpus else ""
    nodes = f"{spec.min_nodes}-{spec.nodes}" if spec.elastic else str(spec.nodes)
    retryable = " ".join(str(c) for c in spec.restart.retryable_exit_codes)
    config_json = shlex.quote(spec.config_json)
    # Shell words: the node count, endpoint and id are the job's, expanded by bash when it runs.
    torchrun = " ".join(spec.torchrun_args(
        node_count=f'"${{SLURM_NNODES:-{spec.nodes}}}"', rdzv_endpoint='"$head_node:$rdzv_port"',
        rdzv_id='"slurm-$SLURM_JOB_ID"', rdzv_conf="join_timeout=120,last_call_timeout=1,close_timeout=10",
        extra=[f"--signals-to-handle={TORCHRUN_SIGNALS}", f"--shutdown-timeout={int(spec.grace_seconds)}"],
        config_json='"$CONFIG_JSON"'))
    return f"""#!/bin/bash
#SBATCH --job-name={spec.name}
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task={spec.resources.cpu}
{gpus}#SBATCH --requeue
#SBATCH --signal=B:USR1@{grace}
#SBATCH --open-mode=append
#SBATCH --output={spec.name}-%j.out
# Rendered by `relaunch render slurm`: {spec.nodes} node(s) x {spec.procs_per_node} process(es), store {spec.store_uri}
set -uo pipefail

[ -n "${{RELAUNCH_ENV_FILE:-}}" ] && source "$RELAUNCH_ENV_FILE"   # credentials, never in this file
export MLFLOW_TRACKING_URI="${{MLFLOW_TRACKING_URI:-{spec.tracking_uri}}}"
export RELAUNCH_OWNER="slurm-${{SLURM_JOB_ID}}"                  # the same writer after a requeue
export RELAUNCH_GIT_COMMIT="${{RELAUNCH_GIT_COMMIT:-unknown}}"
CONFIG_JSON={config_json}

head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
rdzv_port="${{RELAUNCH_RDZV_PORT:-{rdzv_port}}}"
started_at=$(date +%s)

srun_pid=""
forward_usr1() {{
    echo "relaunch: SIGUSR1 from Slurm: asking the workers for an agreed save" >&2
    [ -n "$srun_pid" ] && kill -USR1 "$srun_pid" 2>/dev/null
}}
trap forward_usr1 USR1

srun --kill-on-bad-exit=0 --ntasks-per-node=1 \\
    torchrun {torchrun} &
srun_pid=$!

# a trapped signal interrupts `wait`; keep waiting until srun itself has ended, then take its status
while kill -0 "$srun_pid" 2>/dev/null; do wait "$srun_pid"; done
wait "$srun_pid"
rc=$?

{python} -m relaunch.components.launchers.torchrun --config-json "$CONFIG_JSON" --map-exit "$rc" --since "$started_at"
code=$?
echo "relaunch: training ended with exit code $code (torchrun: $rc)" >&2
case " {retryable} " in
    *" $code "*)
        echo "relaunch: retryable; requeueing job $SLURM_JOB_ID to resume from the latest checkpoint" >&2
        scontrol requeue "$SLURM_JOB_ID"
        ;;
esac
exit "$code"
"""


def render(config: RelaunchConfig, run_id: str) -> str:
    """``relaunch render slurm``: the sbatch script (Slurm names the job itself; ``run_id`` is unused)."""
    if config.train.memory_tier:
        raise BadInput("relaunch render slurm: train.memory_tier is not offered on Slurm (srun torchrun restarts the "
                       "whole group, so the tier would cost 2x memory for nothing); set train.memory_tier=false")
    return render_sbatch(config)
