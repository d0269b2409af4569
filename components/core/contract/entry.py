"""The one entry wrapper: how every entry point ends on a failure.

Each step's ``python -m relaunch.components.<step>`` (what the Argo workflow runs), the KFP component body
(:mod:`relaunch.pipelines.kfp_entry`), the training worker (``python -m relaunch.components.train``) and the
``relaunch`` command line end a failure the same way: the exception's exit code from the one
classifier (:func:`~relaunch.components.core.contract.classify.classify`, by type and source code, never by
message) and one line on stderr. A failure therefore means the same thing, and gets the same retry
decision, on Argo, KFP, a pod and a laptop: an ``MlflowException`` for a 503 or a store SDK's
connection error is 138 everywhere, a ``KeyError`` from a bug is 1 everywhere (its traceback kept
above the line, where the step's log shows it).
"""

from __future__ import annotations

import functools
import sys
import traceback
from dataclasses import dataclass
from typing import Callable

from .classify import as_error, classify
from .errors import RelaunchError
from .exitcodes import ExitCode


@dataclass(frozen=True)
class Failure:
    """How a failure ends its process: the contract's exit code and the one line a person reads."""

    exit_code: int
    message: str
    is_bug: bool


def failure_of(exc: BaseException) -> Failure:
    """``exc`` as the contract sees it: a :class:`RelaunchError` with its own code and message; any
    other exception with :func:`classify`'s code and ``Type: first line`` (the contract error
    :func:`as_error` makes of it)."""
    if isinstance(exc, RelaunchError):
        return Failure(int(exc.exit_code), str(exc), int(exc.exit_code) == ExitCode.BUG)
    code = int(classify(exc))
    return Failure(code, str(as_error(exc)), code == ExitCode.BUG)


def report(prog: str, exc: BaseException) -> Failure:
    """Print ``exc``'s one line (after its traceback when it is a bug of ours or a library's) and
    return how the process ends."""
    failure = failure_of(exc)
    if failure.is_bug and not isinstance(exc, RelaunchError):
        traceback.print_exception(exc, file=sys.stderr)
    print(f"{prog}: error: {failure.message}", file=sys.stderr, flush=True)
    return failure


def exit_on_error(prog: str) -> Callable[[Callable[..., int]], Callable[..., int]]:
    """Decorate an entry point's ``main``: any exception (``SystemExit`` aside) becomes the contract's
    exit code and one line on stderr, through :func:`report`."""

    def decorate(main: Callable[..., int]) -> Callable[..., int]:
        @functools.wraps(main)
        def wrapper(*args, **kwargs) -> int:
            try:
                return main(*args, **kwargs)
            except SystemExit:
                raise
            except BaseException as err:  # noqa: BLE001 - the contract's code for anything, KeyboardInterrupt too
                return report(prog, err).exit_code

        return wrapper

    return decorate
