"""``relaunch render pytorchjob|trainjob|trainingruntime|slurm -o FILE``: what would be submitted, for review.
The kinds are those the registered launch backends offer (:data:`relaunch.components.launchers.LAUNCH_BACKENDS`).

    relaunch render trainjob --config cluster.yaml --run-id manual -o job.yaml    # what launch creates
    relaunch render trainingruntime --config cluster.yaml | kubectl apply -f -    # once per cluster
"""

from __future__ import annotations

import argparse

import yaml

from ...components.core.contract.config import RelaunchConfig
from ...components.core.contract.config_loading import config_from_cli
from ...components.launchers import LAUNCH_BACKENDS, renderers
from . import Subcommands
from .compile import add_config_args, check_output, warn_local_services, write_output


def add_parser(sub: Subcommands, help_text: str) -> None:
    p = sub.add_parser("render", help=help_text, description=help_text)
    p.add_argument("kind", choices=list(renderers()))
    add_config_args(p)
    p.add_argument("--run-id", default="manual", help="pipeline run id the job name is derived from")
    p.add_argument("-o", "--output", default="-", help="file to write, - for stdout")
    p.set_defaults(func=render)


def render(args: argparse.Namespace) -> int:
    config = config_from_cli(args.config, None, args.overrides)
    check_output(args.output)
    write_output(render_kind(args.kind, config, args.run_id), args.output, args.kind)
    if args.kind in cluster_kinds():
        warn_local_services(config, f"the {args.kind} document")
    return 0


def cluster_kinds() -> set[str]:
    """The render kinds of cluster launch backends (pytorchjob, trainjob, ...): documents for pods."""
    return {kind for backend in LAUNCH_BACKENDS.values() if backend.cluster for kind in backend.renders}


def render_kind(kind: str, config: RelaunchConfig, run_id: str = "manual") -> str:
    """What ``relaunch render <kind>`` writes: the backend's text, or its object as YAML."""
    out = renderers()[kind](config, run_id)
    return out if isinstance(out, str) else yaml.safe_dump(out, sort_keys=False)
