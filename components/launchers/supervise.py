"""Run a torchrun command as a child and exit with the contract's exit code, for containers.

    python -m relaunch.components.launchers.supervise torchrun --nnodes=2 ... -m relaunch.components.train --config-json JSON

torchrun exits 1 whenever a worker failed, whatever the worker's own code, and the Training
Operator's ``restartPolicy: ExitCode`` would read that 1 as permanent. This wrapper forwards
SIGTERM/SIGINT/SIGUSR1 to torchrun (the preemption path), waits, and maps torchrun's status with
:func:`relaunch.components.launchers.torchrun.exit_code` (the training's own ``runs/exit.json``), so a worker
killed by OOM restarts the pod (137) and a bad input does not (2).

A job with ``train.memory_tier`` runs the in-place agent under it instead of torchrun
(``supervise python -m relaunch.components.launchers.inplace ... --config-json JSON``, what
:func:`relaunch.components.launchers.inplace.pod_command` renders, one per pod): a killed worker is replaced
inside its pod while its peers in every pod keep their processes; the agent's code needs no mapping and
passes through.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from ..core.contract import suggestions
from ..core.contract.config import RelaunchConfig
from ..core.contract.entry import exit_on_error
from ..core.contract.errors import BadInput
from ..core.runtime import logs, wiring
from ..core.runtime.zygote import for_command
from . import inplace
from .torchrun import exit_code

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


def config_of(command: list[str]) -> RelaunchConfig:
    """The training configuration inside a torchrun command (its ``--config-json`` argument), as its
    workers train it (a cluster study's trial: its own folder, where they record how they ended)."""
    try:
        config = RelaunchConfig.from_json(command[command.index("--config-json") + 1])
    except (ValueError, IndexError):
        raise BadInput("supervise: the torchrun command has no --config-json JSON argument") from None
    return suggestions.from_environment(config)


def supervise(command: list[str]) -> int:
    """Run ``command`` to its end, forwarding signals; return the contract's exit code."""
    config = config_of(command)
    started = time.time()
    json_logs = logs.configure(config, role="agent") == "json"  # logging.format: the agent's lines too
    with for_command(command, (config.train.task.split(":")[0],)) as env:  # the pod's zygote, when its workers use it
        child = subprocess.Popen(command, env=env, stderr=subprocess.PIPE if json_logs else None)
        relay = logs.relay(child.stderr) if json_logs else None
        for sig in FORWARDED:
            signal.signal(sig, lambda signum, _frame: child.send_signal(signum))
        returncode = child.wait()
        if relay is not None:
            relay.join(10)
    code = exit_code(config, returncode, started)
    what = "in-place agent" if inplace.MODULE in command else "torchrun"
    print(f"relaunch supervise: {what} exit {returncode} -> {code}", file=sys.stderr)
    return code


@exit_on_error("relaunch supervise")
def main(argv: list[str] | None = None) -> int:
    wiring.wire()
    command = list(sys.argv[1:] if argv is None else argv)
    if not command:
        raise BadInput("usage: python -m relaunch.components.launchers.supervise torchrun ... --config-json JSON")
    return supervise(command)


if __name__ == "__main__":
    sys.exit(main())
