"""``relaunch``: the command line of the pipeline.

    relaunch run [--config FILE] [--set key=value ...] [--inject-failure kill-worker@step=N]
    relaunch tune --config FILE [--set key=value ...] [--study NAME] [--resume]
    relaunch checkpoints list|latest|verify --store URI [--json]
    relaunch trainings [--store URI] [--json]
    relaunch compile --target kfp|argo|argo-template|argo-cron -o FILE
    relaunch submit --target kfp|argo        relaunch schedule --target kfp|argo --cron EXPR
    relaunch render pytorchjob|trainjob|trainingruntime|slurm -o FILE
    relaunch --version

Each subcommand lives in ``pipelines/commands/<name>.py`` with ``add_parser(subparsers)``; only the
one asked for is imported, so ``relaunch checkpoints`` does not pay for importing kfp and hera.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from ..components.core.contract.entry import exit_on_error
from ..components.core.runtime.wiring import wire

COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("relaunch.pipelines.commands.run", "run the whole pipeline on this machine (kfp.local)"),
    "tune": ("relaunch.pipelines.commands.tune",
             "run a study of trainings on this machine (Optuna): trials that resume from their checkpoints"),
    "checkpoints": ("relaunch.pipelines.commands.checkpoints", "list, locate and verify committed checkpoints in a store"),
    "trainings": ("relaunch.pipelines.commands.trainings",
                  "list the trainings of a store with their state (running, interrupted, trained, finished)"),
    "compile": ("relaunch.pipelines.commands.compile", "compile the pipeline for Kubeflow Pipelines or Argo Workflows"),
    "submit": ("relaunch.pipelines.commands.submit", "submit one pipeline run to a cluster"),
    "schedule": ("relaunch.pipelines.commands.schedule", "create a recurring run on a cluster"),
    "render": ("relaunch.pipelines.commands.render",
               "write the PyTorchJob, TrainJob, ClusterTrainingRuntime or Slurm script the launcher would submit"),
}
"""Each subcommand: its module (imported only when asked for) and its help line."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own exit code is 2 as well; keep one line
        self.exit(2, f"{self.prog}: error: {_with_a_guess(message)}\n")


def _with_a_guess(message: str) -> str:
    """argparse's "invalid choice: 'lst' (choose from ...)" with "did you mean 'list'?" added."""
    import difflib
    import re

    found = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
    if not found:
        return message
    choices = re.findall(r"'([^']*)'", found[2]) or [c.strip() for c in found[2].split(",")]
    close = difflib.get_close_matches(found[1], choices, n=1, cutoff=0.5)
    return f"{message}; did you mean {close[0]!r}?" if close else message


def version() -> str:
    """The installed relaunch package's version (``relaunch --version``)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("relaunch")
    except PackageNotFoundError:  # a source tree on PYTHONPATH without `pip install -e .`
        return "unknown (not installed; pip install -e .)"


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = _Parser(prog="relaunch", description="Fault-tolerant, resumable PyTorch training pipelines.")
    parser.add_argument("--version", action="version", version=f"relaunch {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, (module, help_text) in COMMANDS.items():
        if only is None or only == name:
            importlib.import_module(module).add_parser(sub, help_text)
        else:
            sub.add_parser(name, help=help_text)
    return parser


@exit_on_error("relaunch")
def main(argv: list[str] | None = None) -> int:
    wire()
    argv = list(sys.argv[1:] if argv is None else argv)
    only = argv[0] if argv and argv[0] in COMMANDS else None
    parser = build_parser(only)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
