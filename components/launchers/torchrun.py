"""The one torchrun command line and the one mapping of torchrun's exit status, for every launcher.

    python -m components.launchers.torchrun --config-json JSON --map-exit RC --since EPOCH_SECONDS

:func:`torchrun_args` is what the local agents, the PyTorchJob, the TrainJob and the Slurm script
run (each passes only where the rendezvous is); :func:`exit_code` is how each of them (the local
launcher, the container supervisor, the Slurm script through the CLI above) turns torchrun's status
into the contract's code. torchrun exits 1 whenever a worker failed, whatever the worker's own code,
so the training's ``runs/exit.json`` says what really happened.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from components.core.contract.config import RelaunchConfig
from components.core.contract.exitcodes import ExitCode, normalize

TRAIN_MODULE = "components.train"


def nnodes(config: RelaunchConfig) -> str:
    """``N`` or the elastic range ``MIN:N``."""
    launch = config.launch
    return f"{launch.min_nodes}:{launch.nodes}" if launch.min_nodes and launch.min_nodes != launch.nodes else str(launch.nodes)


def torchrun_args(config: RelaunchConfig, *, rdzv_endpoint: str, rdzv_id: str, node_count: str | None = None,
                  rdzv_conf: str | None = None, extra: Sequence[str] = (), config_json: str | None = None) -> list[str]:
    """torchrun's arguments (what follows ``torchrun``) that train ``config`` (side-effect free).

    Args:
        config: nodes, processes per node, restarts and monitor interval come from ``config.launch``.
        rdzv_endpoint: ``host:port`` of the c10d rendezvous (the only thing launchers really differ in).
        rdzv_id: the rendezvous id, the same on every node of one job.
        node_count: ``--nnodes`` when the launcher knows better (Slurm's ``$SLURM_NNODES``).
        rdzv_conf: ``--rdzv-conf`` (``is_host=true`` for the local agent that hosts the store).
        extra: further torchrun flags, placed before the training module.
        config_json: what ``--config-json`` gets; defaults to ``config`` itself.

    Returns:
        ``[--nnodes=..., ..., -m, components.train, --config-json, JSON]``.
    """
    launch = config.launch
    args = [f"--nnodes={node_count or nnodes(config)}", f"--nproc-per-node={launch.procs_per_node}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv_endpoint}", f"--rdzv-id={rdzv_id}"]
    if rdzv_conf:
        args.append(f"--rdzv-conf={rdzv_conf}")
    args += [f"--max-restarts={launch.max_restarts}", f"--monitor-interval={launch.monitor_interval_seconds:g}",
             *extra, "-m", TRAIN_MODULE, "--config-json", config.to_json() if config_json is None else config_json]
    return args


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
    from components.core.contract.classify import torchrun_exit

    if normalize(returncode) != ExitCode.BUG:  # 0, or a signal: no record needed
        return torchrun_exit(returncode, None, started_at)
    from components.core.contract.errors import RelaunchError
    from components.core.store.records import read_exit_record
    from components.core.store import open_store

    try:
        record = read_exit_record(open_store(config.store.uri))
    except RelaunchError as err:
        print(f"relaunch: cannot read the training's exit record: {err}", file=sys.stderr)
        return normalize(reported) if reported else int(ExitCode.RETRY_ME)
    return torchrun_exit(returncode, record, started_at)


def main(argv: list[str] | None = None) -> int:
    """``--map-exit RC``: exit with the contract's code for a torchrun that ended with RC (Slurm script)."""
    from components.core.contract.config import config_from_cli
    from components.core.contract.errors import exit_on_error

    parser = argparse.ArgumentParser(prog="python -m components.launchers.torchrun", description=main.__doc__)
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
