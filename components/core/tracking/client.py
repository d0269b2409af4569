"""The MLflow run life cycle of a training, and the client calls every step shares.

One MLflow run per training: :func:`ensure_run` finds or creates it before the first attempt (the
pipeline's prepare step, or the trainer on its first start, which stores the id beside the
checkpoints); every attempt logs into it, through the asynchronous logger of
:mod:`relaunch.components.core.tracking.runlogger`; the exit task ends it with :func:`mark_run_finished`. Only rank 0
talks to the server.

Errors are classified by :func:`relaunch.components.core.contract.classify.classify` from what the server answered,
never by message text: MLflow's error code (``RESOURCE_DOES_NOT_EXIST``, ``PERMISSION_DENIED``, ...;
MLflow itself turns a bare HTTP 401/403 into ``UNAUTHENTICATED``/``PERMISSION_DENIED``). :func:`call`
turns refused credentials and a request the server refused into :class:`BadInput` (exit 2), and
anything else (no answer, a 5xx, a database error) into :class:`TransientFailure` (exit 138, retried).

The tracking URI is ``MLFLOW_TRACKING_URI`` when set, else ``config.tracking.uri``; credentials come
only from the environment (``MLFLOW_TRACKING_USERNAME``/``_PASSWORD``/``_TOKEN``).

Under KFP's MLflow integration (KFP 2.17, KEP-12862) the API server opens one parent run per pipeline run,
the driver a nested run per task, and each task's container gets ``MLFLOW_TRACKING_URI``,
``MLFLOW_EXPERIMENT_ID`` and ``MLFLOW_RUN_ID`` (the *task's* nested run, which KFP's launcher closes when
the task ends). The training outlives any one task (prepare opens it, launch logs into it, finalize ends
it), so it is neither the task's run nor a second top-level run: it is created in the injected run's
experiment, nested (``mlflow.parentRunId``) under the pipeline's parent run, the injected run's own parent.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
import time
from typing import Any

from ..contract import classify as classifier
from ..contract.errors import BadInput, TransientFailure
from ..contract.events import Kind, write
from ..contract.exitcodes import ExitCode
from .localdb import database_path, seed_new_database, use_write_ahead_log

PIPELINE_RUN_TAG = "relaunch.pipeline_run_id"
PARENT_RUN_TAG = "mlflow.parentRunId"  # what makes a run nested, in MLflow's UI and API
KFP_TASK_RUN_TAG = "relaunch.kfp_task_run_id"  # the task run KFP injected when the training run was created
END_REASON_TAG = "relaunch.end_reason"
STATUSES = ("FINISHED", "FAILED", "KILLED", "RUNNING")
PARAMS_PER_REQUEST = 100  # MLflow's log_batch limit on params per request
TAGS_PER_REQUEST = 100  # and on tags
_MAX_TAG_VALUE = 5000
_MAX_PARAM_VALUE = 6000
TRIES = 4
"""How many times one call to the tracking server is tried before its step gives up (exit 138)."""
RETRY_DELAYS = (1.0, 2.0, 4.0)
"""Seconds before the second, third and fourth try: a server answering 500 costs a step ~7 s, not minutes."""
REQUEST_TIMEOUT_SECONDS = 10
"""One request's timeout (``MLFLOW_HTTP_REQUEST_TIMEOUT`` when it is set)."""


def tracking_uri(config) -> str:
    """``MLFLOW_TRACKING_URI`` from the environment when set, else ``config.tracking.uri``; the
    variable is held to the checks ``--set tracking.uri`` passes through (BadInput, one line, when not)."""
    from_env = os.environ.get("MLFLOW_TRACKING_URI")
    if not from_env:
        return config.tracking.uri
    from ..contract.uris import check_tracking_uri

    try:
        return check_tracking_uri(from_env)
    except ValueError as err:
        raise BadInput(f"MLFLOW_TRACKING_URI: {err} (or unset it to use tracking.uri)") from None


_MLFLOW_IMPORT = threading.Lock()


def import_mlflow(*modules: str) -> None:
    """Import mlflow (and ``modules``) under one process-wide lock. The trainer imports mlflow off its
    main thread, in more than one thread (the logger's sender, the system-metrics starter): two
    threads importing it at once see each other's half-initialised modules ("cannot import name ...
    from partially initialized module")."""
    with _MLFLOW_IMPORT:
        for name in ("mlflow", "mlflow.tracking", "mlflow.entities", *modules):
            importlib.import_module(name)


def bound_requests() -> None:
    """MLflow's own retries off (7 of them with backoff: 4 minutes of silence per call against a server
    answering 500) and a request timeout, unless the environment sets them: the retries are ours,
    bounded and one line each (:func:`call`, the run logger's)."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(REQUEST_TIMEOUT_SECONDS))


def say(line: str) -> None:
    """One line about the tracking server: on stderr, and as a ``tracking`` event for ``relaunch run``'s
    console (the run's event file, when ``RELAUNCH_EVENTS`` names one)."""
    print(line, file=sys.stderr, flush=True)
    write(Kind.TRACKING, line=line)


def client(uri: str):
    """An ``MlflowClient`` for ``uri`` (never the fluent API: it would export the URI process-wide),
    its requests bounded (:func:`bound_requests`)."""
    bound_requests()
    import_mlflow()
    from mlflow.tracking import MlflowClient

    if uri.startswith("sqlite:"):
        use_write_ahead_log()
        seed_new_database(uri)
    return MlflowClient(tracking_uri=uri)


def describe(err: Exception) -> str:
    """The first line of an error, short enough for one log line; a request that urllib3 gave up on (what
    MLflow's client raises for a 5xx or no answer) as its URL and urllib3's reason."""
    from urllib3.exceptions import MaxRetryError

    cause: BaseException | None = err
    while cause is not None and not isinstance(cause, MaxRetryError):
        cause = cause.__cause__ or cause.__context__
    if cause is not None and cause.pool is not None:
        pool = cause.pool
        return f"{pool.scheme}://{pool.host}:{pool.port}{(cause.url or '').split('?')[0]}: {cause.reason}"[:300]
    return str(err).splitlines()[0][:300] if str(err) else type(err).__name__


# ---------------------------------------------------------------------------------- classification

def is_auth_error(err: Exception) -> bool:
    """The server refused the credentials (HTTP 401/403): MLflow's error code, never a "401" in the
    message (a URL's port or a run id can contain those digits)."""
    return classifier.is_auth_error(err)


def is_not_found(err: Exception, *, alias_lookup: bool = False) -> bool:
    """The server answered that the run, experiment, model or version does not exist: MLflow's
    ``RESOURCE_DOES_NOT_EXIST`` error code (what every store and the REST client raise), not any
    message that happens to contain "not found" (a proxy's 404 page, a missing DNS name). A missing
    alias is answered with ``INVALID_PARAMETER_VALUE`` instead (MLflow 3's registry stores): with
    ``alias_lookup`` that code counts too."""
    code = getattr(err, "error_code", "")
    return code == "RESOURCE_DOES_NOT_EXIST" or (alias_lookup and code == "INVALID_PARAMETER_VALUE")


def is_rejected(err: Exception) -> bool:
    """An answer of the server that refuses the request itself (4xx other than auth): retrying cannot help."""
    return getattr(err, "error_code", "") in classifier.MLFLOW_REFUSED_CODES


def call(what: str, fn, *args, **kwargs):
    """One client call, with the contract's errors: credentials -> BadInput, anything else -> TransientFailure.

    What retrying may help (no answer, a 5xx, a database error) is tried :data:`TRIES` times, with one
    line per failed try (:func:`say`), within a bounded time; a refusal is raised at once."""
    for attempt in range(1, TRIES + 1):
        try:
            return fn(*args, **kwargs)
        except BadInput:
            raise
        except Exception as err:  # mlflow raises MlflowException, requests/sqlalchemy their own
            error = contract_error(err, what)
            if isinstance(error, BadInput):
                raise error from None
            if attempt == TRIES:
                raise TransientFailure(f"{error} ({TRIES} tries)") from None
            delay = RETRY_DELAYS[min(attempt, len(RETRY_DELAYS)) - 1]
            say(f"relaunch: tracking: could not {what} (try {attempt}/{TRIES}): {describe(err)}; "
                f"trying again in {delay:g}s")
            time.sleep(delay)
    raise AssertionError("unreachable")


def unless_missing(fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, or None when the server answers that what it asked for does not exist."""
    try:
        return fn(*args, **kwargs)
    except Exception as err:
        if is_not_found(err):
            return None
        raise


def check_api(uri: str, experiment: str) -> None:
    """Whether the MLflow server at ``uri`` answers a real API request (a server's ``/health`` may answer
    200 while its API answers 500): ``experiments/get-by-name``, through :func:`call`'s bounded tries,
    one line per failed try. Plain ``urllib`` with the environment's credentials: importing MLflow
    would cost the command line a second and a half.

    Raises:
        TransientFailure: the API did not answer, or answered 5xx, on every try.
    """
    import base64
    import urllib.error
    import urllib.parse
    import urllib.request

    query = urllib.parse.urlencode({"experiment_name": experiment})
    request = urllib.request.Request(f"{uri.rstrip('/')}/api/2.0/mlflow/experiments/get-by-name?{query}")
    if os.environ.get("MLFLOW_TRACKING_TOKEN"):
        request.add_header("Authorization", f"Bearer {os.environ['MLFLOW_TRACKING_TOKEN']}")
    elif os.environ.get("MLFLOW_TRACKING_USERNAME") and os.environ.get("MLFLOW_TRACKING_PASSWORD"):
        basic = f"{os.environ['MLFLOW_TRACKING_USERNAME']}:{os.environ['MLFLOW_TRACKING_PASSWORD']}"
        request.add_header("Authorization", f"Basic {base64.standard_b64encode(basic.encode()).decode()}")
    timeout = float(os.environ.get("MLFLOW_HTTP_REQUEST_TIMEOUT") or REQUEST_TIMEOUT_SECONDS)

    def ask() -> None:
        try:
            with urllib.request.urlopen(request, timeout=timeout):
                return
        except urllib.error.HTTPError as err:
            if err.code < 500:  # the API answered (404: no such experiment yet); credentials are the steps' to check
                return
            body = " ".join(err.read(300).decode("utf-8", "replace").split())
            raise TransientFailure(f"HTTP {err.code}" + (f": {body}" if body else "")) from None

    try:
        call(f"get an answer from the MLflow API at {uri}", ask)
    except TransientFailure as err:
        raise TransientFailure(f"{err}; its /health answers, so the server runs but what it stores into (its "
                               "database) fails: see the server's log, then run again") from None


def contract_error(err: Exception, what: str) -> BadInput | TransientFailure:
    """The contract's error for a failed client call (see :func:`call`)."""
    if is_auth_error(err):
        return BadInput(f"tracking: the server refused the credentials while trying to {what}; "
                        "check MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD")
    if classifier.classify(err) == ExitCode.BAD_INPUT:
        return BadInput(f"tracking: the server refused to {what}: {describe(err)}")
    return TransientFailure(f"tracking: could not {what}: {describe(err)}")


# ---------------------------------------------------------------------------------- the shared helpers


def set_run_status(mlflow_client, run_id: str, status: str) -> None:
    """RUNNING (a new attempt reopens the run) or a terminal status; raises what the client raises."""
    if status not in STATUSES:
        raise BadInput(f"run status {status!r} is not one of {', '.join(STATUSES)}")
    if status == "RUNNING":
        mlflow_client.update_run(run_id, status="RUNNING")
    else:
        mlflow_client.set_terminated(run_id, status)


def log_new_params(mlflow_client, run_id: str, params: dict[str, Any]) -> None:
    """Log the params the run does not hold yet; one it holds with another value (MLflow params are
    immutable) becomes the tag ``param.<key>.latest``. Raises what the client raises."""
    from mlflow.entities import Param, RunTag

    values = {k: str(v)[:_MAX_PARAM_VALUE] for k, v in params.items() if v is not None}
    existing = mlflow_client.get_run(run_id).data.params
    new = [Param(k, v) for k, v in values.items() if k not in existing]
    changed = [RunTag(f"param.{k}.latest", v) for k, v in values.items() if k in existing and existing[k] != v]
    for i in range(0, len(new), PARAMS_PER_REQUEST):
        mlflow_client.log_batch(run_id, params=new[i:i + PARAMS_PER_REQUEST])
    if changed:
        mlflow_client.log_batch(run_id, tags=changed)


def find_run(mlflow_client, experiment_id: str, pipeline_run_id: str) -> str | None:
    """The run of ``experiment_id`` tagged ``relaunch.pipeline_run_id=<id>``, or None."""
    return call("search runs", _search_run, mlflow_client, experiment_id, pipeline_run_id)


def _search_run(mlflow_client, experiment_id: str, pipeline_run_id: str) -> str | None:
    found = mlflow_client.search_runs([experiment_id], filter_string=f"tags.`{PIPELINE_RUN_TAG}` = '{pipeline_run_id}'",
                                      max_results=1)
    return found[0].info.run_id if found else None


def find_pipeline_run(config, pipeline_run_id: str) -> str | None:
    """The run a pipeline run opened (looked up, never created), or None. Under KFP's MLflow
    integration it is looked for in the injected run's experiment, where :func:`ensure_run` made it."""
    mlflow_client = client(tracking_uri(config))
    kfp = kfp_parent(mlflow_client)
    if kfp is not None:
        return find_run(mlflow_client, kfp[0], pipeline_run_id)
    experiment = call("look up the experiment", mlflow_client.get_experiment_by_name, config.tracking.experiment)
    return None if experiment is None else find_run(mlflow_client, experiment.experiment_id, pipeline_run_id)


def injected_run_id() -> str | None:
    """The run an orchestrator injected as ``MLFLOW_RUN_ID`` (KFP's MLflow integration: the task's nested run)."""
    return os.environ.get("MLFLOW_RUN_ID") or None


def kfp_parent(mlflow_client) -> tuple[str, str] | None:
    """``(experiment id, parent run id)`` under which the training run belongs when a run was injected
    (``MLFLOW_RUN_ID``): the injected run's experiment and its parent (the pipeline's run), or the
    injected run itself when it has no parent. None when nothing was injected.

    Raises:
        BadInput: the injected run does not exist at the tracking URI, or credentials are refused.
        TransientFailure: the tracking server cannot be reached.
    """
    task_run_id = injected_run_id()
    if not task_run_id:
        return None
    try:
        run = mlflow_client.get_run(task_run_id)
    except Exception as err:
        if is_not_found(err):
            raise BadInput(f"MLFLOW_RUN_ID: run {task_run_id!r} does not exist at the tracking server "
                           "(MLFLOW_TRACKING_URI); unset MLFLOW_RUN_ID or point MLFLOW_TRACKING_URI at its server") from None
        raise contract_error(err, f"read the injected run {task_run_id}") from None
    return run.info.experiment_id, run.data.tags.get(PARENT_RUN_TAG) or task_run_id


def _experiment_id(mlflow_client, config) -> str:
    name = config.tracking.experiment
    found = call(f"look up experiment {name!r}", mlflow_client.get_experiment_by_name, name)
    if found is not None:
        return found.experiment_id
    uri = tracking_uri(config)
    # a server that proxies artifacts chooses the location itself
    location = None if uri.startswith(("http://", "https://")) else config.tracking.artifact_location
    if location and "://" not in location:
        location = os.path.abspath(location)
    try:
        return mlflow_client.create_experiment(name, artifact_location=location)
    except Exception as err:  # another process created it first
        found = mlflow_client.get_experiment_by_name(name)
        if found is None:
            raise contract_error(err, f"create experiment {name!r}") from None
        return found.experiment_id


def run_exists(config, run_id: str) -> bool:
    """Whether MLflow run ``run_id`` exists at the configuration's tracking URI (a sqlite database
    that does not exist holds none, and asking does not create it).

    Raises:
        BadInput: the server refuses the credentials.
        TransientFailure: the tracking server cannot be reached.
    """
    uri = tracking_uri(config)
    database = database_path(uri)
    if database is not None and not database.exists():
        return False
    mlflow_client = client(uri)
    return call(f"read run {run_id}", unless_missing, mlflow_client.get_run, run_id) is not None


def ensure_run(config, pipeline_run_id: str | None = None, tags: dict[str, str] | None = None) -> str:
    """Find or create the MLflow run of this training; returns its run id.

    ``config.tracking.run_id`` wins when set (it must exist). Else, with ``pipeline_run_id``, the run
    of ``config.tracking.experiment`` tagged ``relaunch.pipeline_run_id=<id>`` is returned, created
    with that tag when there is none. When an orchestrator injected ``MLFLOW_RUN_ID`` (KFP's MLflow
    integration), the experiment is the injected run's and a created run is nested under the
    pipeline's run (see :func:`kfp_parent`): never a second top-level run beside KFP's.

    ``tags`` are set on a run this call creates.

    Raises:
        BadInput: ``tracking.run_id`` does not exist, or the server refuses the credentials.
        TransientFailure: the tracking server cannot be reached.
    """
    mlflow_client = client(tracking_uri(config))
    if config.tracking.run_id:
        if not run_exists(config, config.tracking.run_id):
            raise BadInput(f"tracking.run_id: run {config.tracking.run_id!r} does not exist at "
                           f"{tracking_uri(config)}; unset it to create one")
        return config.tracking.run_id
    kfp = kfp_parent(mlflow_client)
    experiment_id = kfp[0] if kfp else _experiment_id(mlflow_client, config)
    if pipeline_run_id:
        found = find_run(mlflow_client, experiment_id, pipeline_run_id)
        if found:
            return found
    tags = {**(tags or {}), "relaunch.pipeline": config.name}
    if kfp:
        tags[PARENT_RUN_TAG] = kfp[1]
        tags[KFP_TASK_RUN_TAG] = injected_run_id()
    if pipeline_run_id:
        tags[PIPELINE_RUN_TAG] = pipeline_run_id

    def find_or_create() -> str:  # a retried create must not make a second run: a failed try may have made one
        found = pipeline_run_id and _search_run(mlflow_client, experiment_id, pipeline_run_id)
        if found:
            return found
        return mlflow_client.create_run(experiment_id, run_name=config.tracking.run_name, tags=tags).info.run_id

    return call("create a run", find_or_create)


def reopen_run(config, run_id: str) -> None:
    """A run an earlier pipeline of the training ended (KILLED by a Ctrl-C, FAILED) is RUNNING again,
    without that ending's reason tag: what the run says is true while the training continues.

    Raises:
        TransientFailure: the tracking server cannot be reached.
    """
    mlflow_client = client(tracking_uri(config))
    run = call("read the run", mlflow_client.get_run, run_id)
    if END_REASON_TAG in run.data.tags:
        call("untag the run", mlflow_client.delete_tag, run_id, END_REASON_TAG)
    if run.info.status != "RUNNING":
        call("update the run", set_run_status, mlflow_client, run_id, "RUNNING")


def mark_run_finished(config, run_id: str, status: str, reason: str = "") -> None:
    """Set the run's terminal status (FINISHED, FAILED or KILLED) and, when given, a reason tag; a
    FINISHED run loses the reason tag an earlier failure left.

    Raises:
        BadInput: an unknown status or refused credentials.
        TransientFailure: the tracking server cannot be reached.
    """
    if status not in STATUSES:
        raise BadInput(f"run status {status!r} is not one of {', '.join(STATUSES)}")
    mlflow_client = client(tracking_uri(config))
    if reason:
        call("tag the run", mlflow_client.set_tag, run_id, END_REASON_TAG, reason[:_MAX_TAG_VALUE])
    elif status == "FINISHED" and END_REASON_TAG in call("read the run", mlflow_client.get_run, run_id).data.tags:
        # a failed attempt's or an earlier pipeline's reason; the attempt tags keep each attempt's exit code
        call("untag the run", mlflow_client.delete_tag, run_id, END_REASON_TAG)
    call("end the run" if status != "RUNNING" else "update the run", set_run_status, mlflow_client, run_id, status)

