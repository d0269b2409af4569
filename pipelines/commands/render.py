"""``relaunch render pytorchjob|trainjob|trainingruntime|slurm -o FILE``: what would be submitted, for review.

    relaunch render trainjob --config cluster.yaml --run-id manual -o job.yaml    # what launch creates
    relaunch render trainingruntime --config cluster.yaml | kubectl apply -f -    # once per cluster
"""

from __future__ import annotations

import argparse

import yaml

from components.core.contract.config import RelaunchConfig, config_from_cli
from pipelines.commands.compile import add_config_args, write_output


def _pytorchjob(config: RelaunchConfig, run_id: str) -> str:
    from components.launchers.pytorchjob import build_pytorchjob

    return yaml.safe_dump(build_pytorchjob(config, pipeline_run_id=run_id), sort_keys=False)


def _trainjob(config: RelaunchConfig, run_id: str) -> str:
    from components.launchers.trainjob import build_trainjob

    return yaml.safe_dump(build_trainjob(config, pipeline_run_id=run_id), sort_keys=False)


def _trainingruntime(config: RelaunchConfig, run_id: str) -> str:
    from components.launchers.trainjob import build_runtime

    return yaml.safe_dump(build_runtime(config), sort_keys=False)


def _slurm(config: RelaunchConfig, run_id: str) -> str:
    from components.launchers.slurm import render_sbatch

    return render_sbatch(config)


RENDERERS = {"pytorchjob": _pytorchjob, "trainjob": _trainjob, "trainingruntime": _trainingruntime, "slurm": _slurm}


def add_parser(sub: argparse._SubParsersAction, help_text: str) -> None:
    p = sub.add_parser("render", help=help_text, description=help_text)
    p.add_argument("kind", choices=list(RENDERERS))
    add_config_args(p)
    p.add_argument("--run-id", default="manual", help="pipeline run id the job name is derived from")
    p.add_argument("-o", "--output", default="-", help="file to write, - for stdout")
    p.set_defaults(func=render)


def render(args: argparse.Namespace) -> int:
    config = config_from_cli(args.config, None, args.overrides)
    write_output(RENDERERS[args.kind](config, args.run_id), args.output, args.kind)
    return 0
