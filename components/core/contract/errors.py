"""Exceptions that carry an exit code of the contract in :mod:`relaunch.components.core.contract.exitcodes`."""

from __future__ import annotations

from typing import ClassVar

from .exitcodes import ExitCode

_KINDS: dict[str, type["RelaunchError"]] = {}


class RelaunchError(Exception):
    """An error whose exit code is part of the contract; its message is one line for a person.

    A subclass that other code catches by type declares its own ``kind`` (a stable name, not its
    class name): :class:`CarriedError` rebuilds it on another rank from that kind and its exit code.
    """

    exit_code: int = ExitCode.BUG
    kind: ClassVar[str] = "error"

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "kind" in cls.__dict__:
            _KINDS.setdefault(cls.kind, cls)


class BadInput(RelaunchError):
    """Configuration, URI, credentials or a foreign checkpoint: permanent, never retried."""

    exit_code = ExitCode.BAD_INPUT
    kind = "bad-input"


class TransientFailure(RelaunchError):
    """Infrastructure that failed after in-process retries ran out: retry the whole step."""

    exit_code = ExitCode.RETRY_ME
    kind = "transient"


class Diverged(RelaunchError):
    """The loss became NaN/inf: permanent, the bad state is never checkpointed."""

    exit_code = ExitCode.DIVERGED
    kind = "diverged"


class Preempted(RelaunchError):
    """SIGTERM/SIGUSR1 was honoured: checkpoint committed if the grace period allowed."""

    exit_code = ExitCode.PREEMPTED
    kind = "preempted"


class CorruptCheckpoint(RelaunchError):
    """A checkpoint that fails verification (missing manifest, sha256 mismatch, unsafe pickle)."""

    exit_code = ExitCode.BAD_INPUT
    kind = "corrupt-checkpoint"


class CorruptDataset(RelaunchError):
    """A committed dataset that fails its check as it is read (a shard whose bytes do not match their
    digest, a manifest that does not hash to its version): the store holds damaged data, which a
    retry reads again; permanent, with the way to write it anew in the message."""

    exit_code = ExitCode.BAD_INPUT
    kind = "corrupt-dataset"


class LoaderWorkerLost(RelaunchError):
    """A data-loader worker process of this rank died (SIGKILL, OOM) while the rank waited for its
    batch: the rank ends as a killed process does (137, retryable), and its restart reads the same
    batches again from its position."""

    exit_code = ExitCode.KILLED
    kind = "loader-worker-lost"


class StoreUnwritable(RelaunchError):
    """The store cannot be written and stays so (full: ENOSPC, EDQUOT; read-only: EROFS, or an object
    store's quota or 403 on a write): an environment to fix, not a crash; permanent, never retried."""

    exit_code = ExitCode.BAD_INPUT
    kind = "store-unwritable"


_KINDS[RelaunchError.kind] = RelaunchError
_BY_CODE: dict[int, type[RelaunchError]] = {ExitCode.BAD_INPUT: BadInput, ExitCode.RETRY_ME: TransientFailure,
                                             ExitCode.DIVERGED: Diverged, ExitCode.PREEMPTED: Preempted}


def error_for(code: int, message: str, kind: str = "") -> RelaunchError:
    """The contract's error for exit code ``code``: the class registered as ``kind`` when its exit code
    is ``code``, else the class of that code (BadInput for 2, TransientFailure for 138, ...), else a
    :class:`RelaunchError` that exits ``code``."""
    cls = _KINDS.get(kind)
    if cls is None or int(cls.exit_code) != int(code):
        cls = _BY_CODE.get(int(code), RelaunchError)
    err = cls(message)
    if int(err.exit_code) != int(code):
        err.exit_code = int(code)
    return err

