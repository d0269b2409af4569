"""``relaunch schedule --target kfp|argo --cron EXPR [--config F] [--set k=v]``: a recurring run.

    relaunch schedule --target argo --cron '0 3 * * *' --config cluster.yaml    # a CronWorkflow (Forbid)
    relaunch schedule --target kfp --cron '0 3 * * *' --version v7              # pipeline version + recurring run

One run at a time, missed runs are not caught up. Prints the CronWorkflow name or the recurring run id.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from ...components.core.contract.config_loading import config_from_cli
from ...components.core.contract.errors import BadInput
from . import Subcommands
from .compile import add_config_args, render, warn_local_services
from .submit import kfp_endpoint, send


def add_parser(sub: Subcommands, help_text: str) -> None:
    p = sub.add_parser("schedule", help=help_text, description=help_text)
    p.add_argument("--target", required=True, choices=["kfp", "argo"])
    p.add_argument("--cron", required=True, help="five-field cron expression, e.g. '0 3 * * *'")
    p.add_argument("--param", action="append", default=[], metavar="NAME=VALUE")
    p.add_argument("--version", help="kfp: name of the uploaded pipeline version (default: a timestamp)")
    p.add_argument("--namespace", help="namespace (default: launch.kubernetes.namespace)")
    p.add_argument("--endpoint", help="kfp: the Kubeflow Pipelines API (default: $KF_PIPELINES_ENDPOINT)")
    p.add_argument("--dry-run", action="store_true", help="print the document instead of creating it")
    add_config_args(p)
    p.set_defaults(func=schedule_command)


def check_cron(expr: str) -> str:
    fields = expr.split()
    if len(fields) != 5:
        raise BadInput(f"--cron {expr!r}: expected five fields (minute hour day month weekday), e.g. '0 3 * * *'")
    return expr


def schedule_command(args: argparse.Namespace) -> int:
    config = config_from_cli(args.config, None, args.overrides)
    cron = check_cron(args.cron)

    def schedule_on_kfp(kfp_cluster, package: Path, params: dict[str, str]) -> str:
        version = args.version or time.strftime("v%Y%m%d-%H%M%S", time.gmtime())
        return kfp_cluster.schedule(kfp_cluster.client(kfp_endpoint(args), namespace=args.namespace), package, config,
                                    cron=cron, version=version, arguments=params)

    code = send(args, config, lambda: render("argo-cron", config, cron), schedule_on_kfp)
    warn_local_services(config, "the schedule")
    return code
