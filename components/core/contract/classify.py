"""The one classifier: ``classify(exc) -> ExitCode``, the code of :mod:`relaunch.components.core.contract.exitcodes`
a failure ends the process with.

Every source of failures has one adapter here that reads the failure's *type* and the *code* its
source gave it, never its message (a URL's port or a run id can hold "401"; a proxy's 404 page says
"not found"):

- the contract's own errors (:class:`~relaunch.components.core.contract.errors.RelaunchError`) carry their code;
- torch DCP's ``CheckpointException`` wraps each rank's original error: that one is classified;
- S3 (minio): an ``S3Error`` by its S3 error code, minio's ``ServerError``/``InvalidResponseError``
  and urllib3's transport errors as transient;
- MLflow: an ``MlflowException`` by its ``error_code`` (MLflow maps a non-JSON HTTP 401/403 answer
  to UNAUTHENTICATED/PERMISSION_DENIED itself); requests' ``HTTPError`` by its status;
- torch.distributed: ``DistError`` (backend, network, store) and the elastic rendezvous errors;
- the Kubernetes API: an ``ApiException`` by its HTTP status;
- Python: Ctrl-C, ``ConnectionError`` and ``TimeoutError``; an ``OSError`` of a full or read-only
  store (ENOSPC, EDQUOT, EROFS) is :class:`~relaunch.components.core.contract.errors.StoreUnwritable` (2),
  also where a library wrapped it in an error of its own that no adapter knows (torch's zip writer
  raises ``RuntimeError: unexpected pos`` after the ``OSError`` of a disk that filled in the middle of a
  tensor): the ``OSError`` in its ``__cause__``/``__context__`` chain is the failure (:func:`unwritable_cause`).

Anything else is a bug (1). A library's types are looked up only when that library is already
imported (an exception of it cannot exist otherwise), so classifying costs no import.

Pods and containers end with statuses, not exceptions: :func:`classify_pod` reads them, and
:func:`torchrun_exit` is the one mapping of torchrun's own exit status.
"""

from __future__ import annotations

import errno
import signal
import sys
from dataclasses import dataclass
from typing import Any, Callable

from .errors import CorruptCheckpoint, RelaunchError, StoreUnwritable, error_for
from .exitcodes import PERMANENT, ExitCode, normalize, unrecorded_end

S3_CREDENTIAL_CODES = frozenset({"InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "InvalidToken",
                                 "ExpiredToken", "AllAccessDisabled", "AccountProblem"})
"""S3 error codes of refused credentials: bad input (2)."""
S3_TRANSIENT_CODES = frozenset({"SlowDown", "InternalError", "ServiceUnavailable", "RequestTimeout", "Throttling",
                                "ThrottlingException", "RequestTimeTooSkewed", "OperationAborted", "ServerError",
                                # 409 to a conditional write that raced another write of the key: AWS
                                # asks for a retry, which then gets 412 if the other one won
                                "ConditionalRequestConflict"})
"""S3 error codes worth retrying (as is any answer with a 5xx status)."""
MLFLOW_AUTH_CODES = frozenset({"UNAUTHENTICATED", "PERMISSION_DENIED"})
"""MLflow error codes of refused credentials (what MLflow makes of HTTP 401 and 403)."""
MLFLOW_REFUSED_CODES = frozenset({"INVALID_PARAMETER_VALUE", "BAD_REQUEST", "RESOURCE_ALREADY_EXISTS",
                                  "INVALID_STATE", "RESOURCE_DOES_NOT_EXIST"})
"""MLflow error codes of a request the server answered and refused: retrying cannot help."""
KUBERNETES_REFUSED_STATUSES = frozenset({400, 401, 403, 404, 422})
"""HTTP statuses of the Kubernetes API that refuse the request itself (credentials, RBAC, an invalid
manifest): bad input; any other status is worth retrying."""
POD_PREEMPTION_REASONS = frozenset({"Evicted", "Preempting", "NodeLost", "NodeShutdown", "Shutdown", "Terminated",
                                    "DeletionByTaintManager", "DeletionByPodGC", "UnexpectedAdmissionError"})
"""A pod's ``status.reason`` when it was taken away with its node: preempted (143), retryable."""
UNWRITABLE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})
"""``OSError`` codes of a store that cannot take a write (full, over quota, read-only): the contract's
:class:`~relaunch.components.core.contract.errors.StoreUnwritable` (2)."""


def classify(exc: BaseException) -> ExitCode:
    """The contract's exit code for ``exc``, from its type and its source's error code (see the module
    docstring for the adapters); an error no adapter knows that wraps the ``OSError`` of an unwritable
    store is that store's (2, :func:`unwritable_cause`); 1 (a bug) for anything else."""
    for adapter in ADAPTERS:
        code = adapter(exc)
        if code is not None:
            return code
    return ExitCode.BAD_INPUT if unwritable_cause(exc) is not None else ExitCode.BUG


def as_error(exc: BaseException, what: str = "") -> RelaunchError:
    """``exc`` as the contract's error: a :class:`RelaunchError` as it is, a DCP failure as the rank's
    original error, anything else as the error class of :func:`classify`'s code (``BadInput``,
    ``TransientFailure``, ...) whose message names ``what`` was tried and the failure's first line."""
    if isinstance(exc, RelaunchError):
        return exc
    if _is_dcp_failure(exc):
        original = dcp_original(exc)
        if original is not exc:
            return as_error(original, what)
    code = classify(exc)
    cause = unwritable_cause(exc)
    named = cause if cause is not None else exc  # a wrapped full disk: the OSError says what happened
    text = str(named).splitlines()[0][:300] if str(named) else ""
    message = f"{type(named).__name__}: {text}" if text else type(named).__name__
    if cause is not None:
        return StoreUnwritable(f"could not {what}: {message}" if what else message)
    return error_for(code, f"could not {what}: {message}" if what else message)


def is_store_unwritable(exc: BaseException) -> bool:
    """Whether ``exc`` says that the store cannot be written (full, over quota, read-only): a
    :class:`StoreUnwritable`, an ``OSError`` of :data:`UNWRITABLE_ERRNOS` (also wrapped, see
    :func:`unwritable_cause`), or a DCP failure or a carried error of either; by type and code only."""
    return isinstance(as_error(exc), StoreUnwritable)


def unwritable_cause(exc: BaseException) -> OSError | None:
    """The ``OSError`` of :data:`UNWRITABLE_ERRNOS` that ``exc`` is, or that it wraps when no adapter
    knows ``exc`` itself (it would be a bug, 1): the first such error of its ``__cause__`` and
    ``__context__`` chain. A library that fails while it handles the ``OSError`` of a full disk raises
    an error of its own without the errno (torch's zip writer: ``RuntimeError: [enforce fail at
    inline_container.cc] unexpected pos``), with the ``OSError`` as its context. An error some adapter
    classifies (a broken collective, a server's answer) is what it says, whatever it was raised from."""
    if _unwritable(exc) is not None:
        return exc  # type: ignore[return-value]
    if any(adapter(exc) is not None for adapter in ADAPTERS):
        return None
    seen, chain = {id(exc)}, [exc.__cause__, exc.__context__]
    while chain:
        err = chain.pop(0)
        if err is None or id(err) in seen:
            continue
        seen.add(id(err))
        if _unwritable(err) is not None:
            return err  # type: ignore[return-value]
        chain += [err.__cause__, err.__context__]
    return None


@dataclass(frozen=True)
class CarriedError:
    """One rank's failure as plain data (what ``all_gather_object`` can carry to the other ranks):
    its exit code and contract kind, never its class name, so no class is looked up by name."""

    exit_code: int
    kind: str
    message: str

    @classmethod
    def of(cls, err: BaseException) -> "CarriedError":
        """Carry ``err``; one that is not the contract's is classified first (see
        :func:`as_error`)."""
        contract = as_error(err)
        return cls(int(contract.exit_code), type(contract).kind, str(contract))

    def rebuild(self, prefix: str = "") -> RelaunchError:
        """The error again, on this rank: the same kind and exit code, ``prefix`` before the message."""
        return error_for(self.exit_code, prefix + self.message, self.kind)


# ---------------------------------------------------------------------------------- adapters


def _code(value: Any) -> ExitCode:
    try:
        return ExitCode(normalize(int(value)))
    except (TypeError, ValueError):
        return ExitCode.BUG


def _module(name: str):
    return sys.modules.get(name)


def _contract(exc: BaseException) -> ExitCode | None:
    return _code(exc.exit_code) if isinstance(exc, RelaunchError) else None


def _is_dcp_failure(exc: BaseException) -> bool:
    api = _module("torch.distributed.checkpoint.api")
    return api is not None and isinstance(exc, api.CheckpointException)


def dcp_failures(exc: BaseException) -> list[BaseException]:
    """The ranks' original errors a DCP ``CheckpointException`` wraps (``failures``: rank -> (error,
    traceback)), in rank order; ``[]`` for any other exception."""
    if not _is_dcp_failure(exc):
        return []
    failures = exc.failures or {}
    return [f[0] if isinstance(f, tuple) else f for _, f in sorted(failures.items())]


def dcp_original(exc: BaseException) -> BaseException:
    """The error DCP wrapped that says most about a failed save or load: a damaged checkpoint first (so
    that every rank falls back together), then the contract's own errors (permanent before
    retryable), then any other error an adapter knows, then the first; ``exc`` itself when it wraps
    none."""
    def rank(err: BaseException) -> int:
        if isinstance(err, CorruptCheckpoint):
            return 0
        code = classify(err)
        if isinstance(err, RelaunchError):
            return 1 if code in PERMANENT else 2
        return 3 if code != ExitCode.BUG else 4

    originals = dcp_failures(exc)
    return min(originals, key=rank) if originals else exc


def _unwritable(exc: BaseException) -> ExitCode | None:
    return ExitCode.BAD_INPUT if isinstance(exc, OSError) and exc.errno in UNWRITABLE_ERRNOS else None


def _dcp(exc: BaseException) -> ExitCode | None:
    if not _is_dcp_failure(exc):
        return None
    original = dcp_original(exc)
    return ExitCode.BUG if original is exc else classify(original)


def _s3(exc: BaseException) -> ExitCode | None:
    minio_error = _module("minio.error")
    if minio_error is not None:
        if isinstance(exc, minio_error.S3Error):
            status = getattr(exc.response, "status", 0) or 0
            if exc.code in S3_TRANSIENT_CODES or status >= 500:
                return ExitCode.RETRY_ME
            return ExitCode.BAD_INPUT  # the server answered and refused: credentials, no bucket, a bad request
        if isinstance(exc, (minio_error.ServerError, minio_error.InvalidResponseError)):
            return ExitCode.RETRY_ME  # a 5xx, or a non-S3 body: a proxy or gateway in the way
    urllib3_errors = _module("urllib3.exceptions")
    if urllib3_errors is not None and isinstance(exc, urllib3_errors.HTTPError):
        return ExitCode.BAD_INPUT if isinstance(exc, urllib3_errors.LocationValueError) else ExitCode.RETRY_ME
    return None


def _mlflow(exc: BaseException) -> ExitCode | None:
    mlflow_errors = _module("mlflow.exceptions")
    if mlflow_errors is not None and isinstance(exc, mlflow_errors.MlflowException):
        code = getattr(exc, "error_code", "")
        return ExitCode.BAD_INPUT if code in MLFLOW_AUTH_CODES | MLFLOW_REFUSED_CODES else ExitCode.RETRY_ME
    requests_errors = _module("requests.exceptions")
    if requests_errors is not None and isinstance(exc, requests_errors.HTTPError) and exc.response is not None:
        status = exc.response.status_code
        return ExitCode.BAD_INPUT if 400 <= status < 500 and status not in (408, 429) else ExitCode.RETRY_ME
    return None


def _distributed(exc: BaseException) -> ExitCode | None:
    dist = _module("torch.distributed")
    if dist is not None and isinstance(exc, dist.DistError):
        return ExitCode.RETRY_ME  # a peer died, the network or the store went away: a restart helps
    rendezvous = _module("torch.distributed.elastic.rendezvous.api")
    if rendezvous is not None and isinstance(exc, rendezvous.RendezvousError):
        return ExitCode.RETRY_ME
    return None


def _kubernetes(exc: BaseException) -> ExitCode | None:
    api = _module("kubernetes.client.exceptions")
    if api is not None and isinstance(exc, api.ApiException):
        return ExitCode.BAD_INPUT if exc.status in KUBERNETES_REFUSED_STATUSES else ExitCode.RETRY_ME
    return None


def _python(exc: BaseException) -> ExitCode | None:
    if isinstance(exc, KeyboardInterrupt):
        return ExitCode.INTERRUPTED
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return ExitCode.RETRY_ME
    return None


ADAPTERS: tuple[Callable[[BaseException], ExitCode | None], ...] = (_contract, _dcp, _unwritable, _s3, _mlflow,
                                                                    _distributed, _kubernetes, _python)
"""Tried in order; the first that knows the failure's type answers."""


def is_auth_error(exc: BaseException) -> bool:
    """The server refused the credentials: MLflow's UNAUTHENTICATED/PERMISSION_DENIED, an S3
    credential code, or requests' HTTP 401/403."""
    if getattr(exc, "error_code", "") in MLFLOW_AUTH_CODES:
        return True
    minio_error = _module("minio.error")
    if minio_error is not None and isinstance(exc, minio_error.S3Error):
        return exc.code in S3_CREDENTIAL_CODES
    requests_errors = _module("requests.exceptions")
    return (requests_errors is not None and isinstance(exc, requests_errors.HTTPError) and exc.response is not None
            and exc.response.status_code in (401, 403))


# ---------------------------------------------------------------------------------- statuses


def classify_pod(pod: dict, container: str) -> list[tuple[ExitCode | int, str]]:
    """How one pod (a Kubernetes ``Pod`` as a dict) ended: ``(code, why)`` for the pod itself when it
    was taken away with its node (143, even without a container exit code), else for each ended
    ``container`` (current and last state): OOMKilled is 137 whatever the runtime reported, a signal
    128 + signal, any other code as it is (a code outside the contract stays visible to the caller).
    ``[]`` while nothing ended or everything ended with 0."""
    name = pod.get("metadata", {}).get("name", "?")
    status = pod.get("status") or {}
    reason = status.get("reason") or ""
    if reason in POD_PREEMPTION_REASONS:
        return [(ExitCode.PREEMPTED, f"pod {name} {reason}: {status.get('message', '')}".strip())]
    found: list[tuple[ExitCode | int, str]] = []
    for cs in status.get("containerStatuses") or []:
        if cs.get("name") not in (None, container):
            continue
        for state_key in ("state", "lastState"):
            term = (cs.get(state_key) or {}).get("terminated")
            if not term or term.get("exitCode") in (None, 0):
                continue
            if term.get("reason") == "OOMKilled":
                found.append((ExitCode.KILLED, f"pod {name} OOMKilled"))
            else:
                code = normalize(int(term["exitCode"]))
                found.append((code, f"pod {name} exited {code} ({term.get('reason') or 'Error'})"))
            break
    return found


AGENT_CRASH_CODES = frozenset(128 + int(s) for s in (signal.SIGABRT, signal.SIGBUS, signal.SIGSEGV))
"""A torchrun that ended so crashed itself: no launcher, kubelet or scheduler stops an agent with these."""


def torchrun_exit(returncode: int, record: dict | None, started_at: float) -> int:
    """The contract's code of a torchrun that ended with ``returncode`` (every launcher's one mapping).

    torchrun exits 1 whenever a worker failed, whatever the worker's own code; ``record`` (the
    training's ``runs/exit.json``, see :mod:`relaunch.components.core.store.ledger`), when written after
    ``started_at``, says what really happened; a failure without such a record is a worker that died
    without control (SIGKILL, OOM): 137. A torchrun killed by a signal maps to 128 + signal, unless it
    crashed itself (:data:`AGENT_CRASH_CODES`) after the training recorded how it ended: torch's agent
    can abort in its own shutdown after a SIGTERM ("terminate called without an active exception"),
    which would make a preemption that committed its checkpoint look like a permanent 134.
    """
    code = normalize(returncode)
    fresh = record is not None and record.get("time", 0) >= started_at and record.get("exit_code")
    if code in AGENT_CRASH_CODES and fresh:
        return int(record["exit_code"])
    if code != ExitCode.BUG:
        return int(code)
    return unrecorded_end(int(record["exit_code"]) if fresh else None)


def dcp_mismatch(flat_state: dict[str, Any], metadata: Any) -> str | None:
    """Why DCP cannot load a checkpoint whose ``metadata`` (DCP's ``Metadata``) into ``flat_state``
    (FQN -> tensor or value, as a load planner holds it): a key the checkpoint lacks, or a tensor of
    another size; None when it fits. DCP itself raises a bare ``RuntimeError``/``ValueError`` for
    these, so a loader checks first and raises :class:`~relaunch.components.core.contract.errors.BadInput` (a checkpoint
    of another model) with this reason."""
    stored = metadata.state_dict_metadata
    missing = sorted(k for k in flat_state if k not in stored)
    if missing:
        return f"the checkpoint has no {', '.join(missing[:5])}" + (f" (and {len(missing) - 5} more)" if len(missing) > 5 else "")
    for key, value in flat_state.items():
        size = getattr(stored[key], "size", None)
        if size is not None and hasattr(value, "size") and tuple(value.size()) != tuple(size):
            return f"{key} is {tuple(size)} in the checkpoint, {tuple(value.size())} here"
    return None
