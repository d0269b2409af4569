"""Exceptions that carry an exit code of the contract in :mod:`components.core.exitcodes`."""

from __future__ import annotations

import functools
import sys
from typing import Callable

from components.core.exitcodes import ExitCode


class RelaunchError(Exception):
    """An error whose exit code is part of the contract; its message is one line for a person."""

    exit_code: int = ExitCode.BUG


class BadInput(RelaunchError):
    """Configuration, URI, credentials or a foreign checkpoint: permanent, never retried."""

    exit_code = ExitCode.BAD_INPUT


class TransientFailure(RelaunchError):
    """Infrastructure that failed after in-process retries ran out: retry the whole step."""

    exit_code = ExitCode.RETRY_ME


class Diverged(RelaunchError):
    """The loss became NaN/inf: permanent, the bad state is never checkpointed."""

    exit_code = ExitCode.DIVERGED


class Preempted(RelaunchError):
    """SIGTERM/SIGUSR1 was honoured: checkpoint committed if the grace period allowed."""

    exit_code = ExitCode.PREEMPTED


class CorruptCheckpoint(RelaunchError):
    """A checkpoint that fails verification (missing manifest, sha256 mismatch, unsafe pickle)."""

    exit_code = ExitCode.BAD_INPUT


def exit_on_error(prog: str) -> Callable[[Callable[..., int]], Callable[..., int]]:
    """Decorate a CLI ``main``: a :class:`RelaunchError` becomes one line on stderr and its exit code."""

    def decorate(main: Callable[..., int]) -> Callable[..., int]:
        @functools.wraps(main)
        def wrapper(*args, **kwargs) -> int:
            try:
                return main(*args, **kwargs)
            except RelaunchError as err:
                print(f"{prog}: error: {err}", file=sys.stderr)
                return int(err.exit_code)

        return wrapper

    return decorate
