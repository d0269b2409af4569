"""``relaunch compile --target kfp|argo|argo-template|argo-cron -o FILE [--config F] [--set k=v]``.

    relaunch compile --target kfp -o build/pipeline.kfp.yaml
    relaunch compile --target argo-cron --cron '0 3 * * *' --config cluster.yaml -o cron.yaml

The configuration becomes the default of the ``config_json`` parameter and names the image, namespace,
service account and Secrets; it never carries credentials. With a ``tune:`` space it compiles the tuning
pipeline (a study: the trials fanned out, the best one evaluated and registered;
:func:`relaunch.pipelines.spec.pipeline_of`).

    relaunch compile --target argo --config configs/tune.yaml --set tune.storage=postgresql://mlflow@postgres/optuna
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
from typing import NoReturn

from ...components.core.contract.config_loading import config_from_cli
from ...components.core.store import parse_store_uri
from ...components.core.contract.errors import BadInput
from . import Subcommands

TARGETS = ["kfp", "argo", "argo-template", "argo-cron"]


def add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML configuration file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")


def add_parser(sub: Subcommands, help_text: str) -> None:
    p = sub.add_parser("compile", help=help_text, description=help_text)
    p.add_argument("--target", required=True, choices=TARGETS)
    p.add_argument("-o", "--output", default="-", help="file to write, - for stdout")
    p.add_argument("--cron", default="0 3 * * *", help="argo-cron: the schedule (five fields)")
    add_config_args(p)
    p.set_defaults(func=compile_command)


def render(target: str, config, cron: str = "0 3 * * *") -> str:
    """The compiled document(s) of ``target`` as YAML text."""
    if target == "kfp":
        import tempfile
        from pathlib import Path

        from ..kfp_cluster import compile_for_cluster

        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "pipeline.yaml"
            compile_for_cluster(path, config)
            return path.read_text()
    from .. import argo

    if target == "argo-cron":
        return argo.to_yaml(argo.build_cron_workflow(config, cron=cron))
    return argo.to_yaml(argo.BUILDERS[target](config))


def compile_command(args: argparse.Namespace) -> int:
    config = config_from_cli(args.config, None, args.overrides)
    check_output(args.output)
    write_output(render(args.target, config, args.cron), args.output, args.target)
    warn_local_services(config, f"the {args.target} document")
    return 0


CLUSTER_CONFIG = "configs/cluster.yaml"
"""The example configuration for a cluster that the warnings point at (docs/cluster.md, section 5)."""


def local_services(config) -> list[str]:
    """What in ``config`` points at this machine and would not work from a cluster's pods: a store that
    is a path (each pod's own disk, unless a shared volume is mounted there), a sqlite or file tracking
    URI (a database file per pod). One line each; empty when the configuration is fit for a cluster."""
    found = []
    if parse_store_uri(config.store.uri)[0] == "file":
        found.append(f"store.uri {config.store.uri!r}, a path: each pod would write its own disk unless a shared "
                     "volume is mounted there; use s3://bucket/prefix")
    if config.tracking.uri.split(":", 1)[0] in ("sqlite", "file"):
        found.append(f"tracking.uri {config.tracking.uri!r}, a file: each pod would track into its own copy; "
                     "use an MLflow server, e.g. http://mlflow.relaunch.svc:5000")
    return found


def warn_local_services(config, what: str) -> None:
    """Warn on stderr (one line per finding, after the document was written or sent) when ``what``
    carries this machine's store or tracking to a cluster. A warning, not a refusal: a path is right on
    a cluster where a shared volume is mounted at it."""
    for finding in local_services(config):
        print(f"relaunch: warning: {what} carries {finding} (--config {CLUSTER_CONFIG} or --set)",
              file=sys.stderr)


def check_output(output: str) -> None:
    """Refuse an ``-o`` whose folder does not exist, or that is a folder, before anything is rendered (a
    render imports the compilers: seconds a mistyped path should not cost)."""
    if output == "-":
        return
    folder = os.path.dirname(output) or "."
    if not os.path.isdir(folder):
        raise BadInput(f"-o {output}: the folder {folder!r} does not exist; create it (mkdir -p) or write elsewhere")
    if os.path.isdir(output):
        _cannot_write(output, os.strerror(errno.EISDIR))


def write_output(text: str, output: str, what: str) -> None:
    """Write ``text`` to the file ``output`` (``-``: stdout) and say so on stderr."""
    if output == "-":
        sys.stdout.write(text)
        return
    check_output(output)
    try:
        with open(output, "w") as fh:
            fh.write(text)
    except OSError as err:
        _cannot_write(output, err.strerror)
    print(f"wrote {output} ({what})", file=sys.stderr)


def _cannot_write(output: str, reason: str) -> NoReturn:
    raise BadInput(f"-o {output}: cannot write it ({reason}); write elsewhere or - for stdout") from None
