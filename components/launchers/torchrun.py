"""The one mapping of torchrun's exit status, for every launcher (the torchrun command line itself is
:meth:`relaunch.components.launchers.jobs.JobSpec.torchrun_args`).

    python -m relaunch.components.launchers.torchrun --config-json JSON --map-exit RC --since EPOCH_SECONDS

:func:`exit_code` is how each launcher (the local launcher, the container supervisor, the Slurm script
through the CLI above) turns torchrun's status into the contract's code. torchrun exits 1 whenever a worker failed, whatever the worker's own code,
so the training's ``runs/exit.json`` says what really happened.
"""

from __future__ import annotations

import argparse
import sys

from ..core.contract.classify import torchrun_exit
from ..core.contract.config import RelaunchConfig
from ..core.contract.config_loading import config_from_cli
from ..core.contract.entry import exit_on_error
from ..core.contract.errors import RelaunchError
from ..core.contract.exitcodes import ExitCode, normalize
from ..core.store import open_store
from ..core.store.records import read_exit_record
from ..core.runtime.wiring import wire

def exit_code(config: RelaunchConfig, returncode: int, started_at: float, *, reported: int | None = None) -> int:
    """The contract's exit code of a torchrun of ``config`` that ended with ``returncode``.

    Args:
        returncode: torchrun's status (negative: killed by that signal, as ``subprocess`` reports it).
        started_at: ``time.time()`` when torchrun started; an older exit record is not this run's.
        reported: the worker exit code torchrun printed, used when the store itself cannot be read.

    Returns:
        0; 128 + signal for a killed torchrun; for torchrun's blanket 1, the code the training
        recorded (137 when it recorded none: a worker that died without control); 138 (or
        ``reported``) when the store cannot be read, rather than guessing a permanent code.
    """
    if normalize(returncode) != ExitCode.BUG:  # 0, or a signal: no record needed
        return torchrun_exit(returncode, None, started_at)

    try:
        record = read_exit_record(open_store(config.store.uri))
    except RelaunchError as err:
        print(f"relaunch: cannot read the training's exit record: {err}", file=sys.stderr)
        return normalize(reported) if reported else int(ExitCode.RETRY_ME)
    return torchrun_exit(returncode, record, started_at)


def main(argv: list[str] | None = None) -> int:
    """``--map-exit RC``: exit with the contract's code for a torchrun that ended with RC (Slurm script)."""
    wire()
    parser = argparse.ArgumentParser(prog="python -m relaunch.components.launchers.torchrun", description=main.__doc__)
    parser.add_argument("--config", help="YAML configuration file")
    parser.add_argument("--config-json", help="the whole configuration as JSON")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--map-exit", type=int, required=True, metavar="RC")
    parser.add_argument("--since", type=float, default=0.0, help="when torchrun started (epoch seconds)")
    args = parser.parse_args(argv)

    @exit_on_error("torchrun --map-exit")
    def mapped() -> int:
        code = exit_code(config_from_cli(args.config, args.config_json, args.overrides), args.map_exit, args.since)
        print(f"relaunch: torchrun exit {args.map_exit} -> {code}", file=sys.stderr)
        return code

    return mapped()


if __name__ == "__main__":
    sys.exit(main())
