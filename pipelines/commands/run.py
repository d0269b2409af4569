"""``relaunch run [--config FILE] [--set key=value ...] [--inject-failure SPEC]``: the whole pipeline
on this machine (kfp.local), with the embedded defaults unless the configuration points elsewhere.

    relaunch run                                      # 2 torchrun "nodes" on CPU, ./.relaunch/ store + MLflow
    relaunch run --inject-failure kill-worker@step=30 # watch a restart resume from the latest checkpoint
    relaunch run --config configs/local.yaml --set train.epochs=1

The configuration, its URIs and the task are checked first: bad input fails (exit 2) before anything
starts. The exit code is the failing step's, per the exit-code contract.
"""

from __future__ import annotations

import argparse
import sys

from components.core.config import config_from_cli, with_pipeline_parameters


def add_parser(sub: argparse._SubParsersAction, help_text: str) -> None:
    p = sub.add_parser("run", help=help_text, description=help_text)
    p.add_argument("--config", help="YAML configuration file (default: the built-in defaults)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one field, e.g. --set train.epochs=2 (repeatable)")
    p.add_argument("--inject-failure", metavar="SPEC",
                   help="kill-worker@step=N, preempt@step=N or storage-outage@step=N (a fault-tolerance demo)")
    p.add_argument("--state-dir", default=".relaunch", help="where kfp.local outputs and run logs go")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from components.prepare import check_inputs

    config = config_from_cli(args.config, None, args.overrides)
    if args.inject_failure:  # typed, like the pipeline parameter of the same name
        config = with_pipeline_parameters(config, {"inject_failure": args.inject_failure})
    check_inputs(config)

    from pipelines.local_run import render_summary, run_pipeline

    console = Console(file=sys.stdout)
    result = run_pipeline(config, console=console, state_dir=args.state_dir)
    render_summary(config, result, console)
    if result.exit_code:
        print(f"relaunch: error: {result.failed_step} failed (exit {result.exit_code}): {result.message}",
              file=sys.stderr)
    return result.exit_code
