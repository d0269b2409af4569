"""The exit-code contract and how a retry is described: the one place both pipelines, the local
runner, the PyTorchJob ``restartPolicy: ExitCode`` and the launchers' failure mapping read (each
step's retries are in the pipeline spec, :data:`relaunch.pipelines.spec.PIPELINE`).

Codes follow the Kubeflow Training Operator's ExitCode restart policy: 1, 2, 126-128 and 139 are
permanent (a bug, bad input, a binary that cannot run, a segfault); 130, 137 and 143 are signals
from the outside (Ctrl-C, SIGKILL/OOM, SIGTERM/preemption) and retryable; 138 is relaunch's own
"transient infrastructure failure, retry me" after in-process retries ran out.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class ExitCode(enum.IntEnum):
    OK = 0
    BUG = 1
    BAD_INPUT = 2
    DIVERGED = 3
    CANNOT_EXECUTE = 126
    COMMAND_NOT_FOUND = 127
    INVALID_EXIT = 128
    INTERRUPTED = 130
    KILLED = 137
    RETRY_ME = 138
    SEGFAULT = 139
    PREEMPTED = 143


MEANING: dict[int, str] = {
    ExitCode.OK: "success",
    ExitCode.BUG: "unhandled error (a bug)",
    ExitCode.BAD_INPUT: ("bad input: configuration, URI, credentials, foreign checkpoint; a store that cannot be "
                         "written (full, read-only)"),
    ExitCode.DIVERGED: "training diverged (NaN/inf loss)",
    ExitCode.CANNOT_EXECUTE: "command cannot execute",
    ExitCode.COMMAND_NOT_FOUND: "command not found",
    ExitCode.INVALID_EXIT: "invalid exit argument",
    ExitCode.INTERRUPTED: "interrupted (SIGINT)",
    ExitCode.KILLED: "killed (SIGKILL, OOM)",
    ExitCode.RETRY_ME: "transient infrastructure failure after local retries (store, rendezvous, tracking)",
    ExitCode.SEGFAULT: "segmentation fault",
    ExitCode.PREEMPTED: "preempted (SIGTERM); checkpoint committed when the grace period allowed",
}

PERMANENT: frozenset[int] = frozenset(
    {ExitCode.BUG, ExitCode.BAD_INPUT, ExitCode.DIVERGED, ExitCode.CANNOT_EXECUTE,
     ExitCode.COMMAND_NOT_FOUND, ExitCode.INVALID_EXIT, ExitCode.SEGFAULT}
)
RETRYABLE: frozenset[int] = frozenset(
    {ExitCode.INTERRUPTED, ExitCode.KILLED, ExitCode.RETRY_ME, ExitCode.PREEMPTED}
)


def is_retryable(code: int) -> bool:
    """Whether a process that ended with ``code`` should be retried.

    Negative codes are Python's way of saying "killed by signal -code"; they map to 128 + signal.
    Unknown codes are treated as permanent: retrying what we do not understand hides bugs.
    """
    return normalize(code) in RETRYABLE


def unrecorded_end(recorded: int | None) -> int:
    """The code of an attempt or worker by what it recorded: ``recorded`` when it wrote one, else 137. A
    process that ended without writing how it ended died without control (SIGKILL, OOM, a lost node):
    the one rule the launchers, the goodput report and the console read an ending by."""
    return int(recorded) if recorded is not None else int(ExitCode.KILLED)


def normalize(code: int) -> int:
    """Map a ``subprocess`` return code (``-9`` for SIGKILL) to the shell convention (137)."""
    return 128 - code if code < 0 else code


@dataclass(frozen=True)
class RetryPolicy:
    """How a pipeline step is retried. Backoff: ``backoff_seconds * factor**attempt`` capped at
    ``max_backoff_seconds``; at most ``limit`` retries after the first attempt."""

    limit: int
    backoff_seconds: int
    factor: int
    max_backoff_seconds: int


def argo_retry_expression() -> str:
    """The Argo ``retryStrategy.expression``: retry the retryable codes, and a pod lost with its
    node (``lastRetry.status == "Error"`` with no exit code of ours), never a permanent code."""
    codes = ", ".join(f"'{c}'" for c in sorted(RETRYABLE))
    permanent = ", ".join(f"'{c}'" for c in sorted(PERMANENT))
    return (
        f"lastRetry.exitCode in [{codes}]"
        f" || (lastRetry.status == 'Error' && !(lastRetry.exitCode in [{permanent}]))"
    )
