"""``relaunch render pytorchjob|slurm -o FILE``: what the launcher would submit, for review."""

from __future__ import annotations

import argparse

import yaml

from components.core.config import config_from_cli
from pipelines.commands.compile import add_config_args, write_output


def add_parser(sub: argparse._SubParsersAction, help_text: str) -> None:
    p = sub.add_parser("render", help=help_text, description=help_text)
    p.add_argument("kind", choices=["pytorchjob", "slurm"])
    add_config_args(p)
    p.add_argument("--run-id", default="manual", help="pipeline run id the job name is derived from")
    p.add_argument("-o", "--output", default="-", help="file to write, - for stdout")
    p.set_defaults(func=render)


def render(args: argparse.Namespace) -> int:
    config = config_from_cli(args.config, None, args.overrides)
    if args.kind == "pytorchjob":
        from components.launchers.kubernetes import build_pytorchjob

        text = yaml.safe_dump(build_pytorchjob(config, pipeline_run_id=args.run_id), sort_keys=False)
    else:
        from components.launchers.slurm import render_sbatch

        text = render_sbatch(config)
    write_output(text, args.output, args.kind)
    return 0
