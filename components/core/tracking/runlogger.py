"""A buffered, asynchronous MLflow logger for the trainer's rank 0: it survives the server being away
and never logs a step twice.

Exactly-once metric points: a step recomputed after a crash is identical (exact resume), so the
logger skips every (key, step) the server already holds. It asks the server for the highest logged
step of the keys it has not sent yet (one ``runs/get`` over REST answers for all of them), and again
after any failed send (the failed request may have been applied), so neither a restart nor a retry
duplicates a point.

To an http(s) server everything but artifact uploads and submitted calls goes through
:mod:`relaunch.components.core.tracking.rest` (MLflow's REST API over one kept-alive connection, MLflow's
credentials): a tenth of the CPU of MLflow's client per request, on a thread that shares the GIL
with the training.

The run itself (find or create, end) is :mod:`relaunch.components.core.tracking.client`'s.
"""

from __future__ import annotations

import collections
import json
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from .client import client as tracking_client
from .client import (TAGS_PER_REQUEST, bound_requests, describe, import_mlflow, is_auth_error,
                     is_not_found, is_rejected, log_new_params, set_run_status)
from .rest import GET_RUN, LOG_BATCH, UPDATE_RUN, RestSession

_BATCH = 1000  # MLflow's log_batch limit on metrics (and tags) per request
WAIT_WHILE_LOST_SECONDS = 10.0
"""How long :meth:`RunLogger.flush` (and close) waits for a server it lost contact with, counted from
the loss: what is still buffered then is the caller's to keep (the trainer's pending-metrics record)."""
# MLflow's request-header providers try these imports on every request (Databricks and notebook
# detection); a module that is not installed is looked for on the whole sys.path each time: 11 failed
# imports and ~4 ms of CPU per request here, on the thread that shares the GIL with the training.
_LOOKED_UP_PER_REQUEST = ("dbruntime", "IPython", "pyspark")


def remember_absent(names=_LOOKED_UP_PER_REQUEST) -> None:
    """Record each module of ``names`` that is not installed as absent (``sys.modules[name] = None``,
    Python's documented negative entry: importing it then fails at once, without a sys.path search)."""
    import importlib.util

    for name in names:
        if name not in sys.modules and importlib.util.find_spec(name) is None:
            sys.modules[name] = None
_FINITE = sys.float_info.max


def _json_number(value: float) -> str:
    """A float as protobuf-JSON accepts it (NaN and infinities are strings there)."""
    if value != value:
        return '"NaN"'
    if value in (float("inf"), float("-inf")):
        return '"Infinity"' if value > 0 else '"-Infinity"'
    return repr(value)




@dataclass
class _Op:
    kind: str  # "metrics" | "tags" | "params" | "artifact" | "status" | "call"
    payload: Any
    attempts: int = 0
    tags: dict[str, str] | None = None  # a metrics op carries the tags set meanwhile: one request for both
    points: int = 0  # a metrics op's points, counted when it was made


@dataclass
class LoggerStats:
    """What the logger measured about itself; the trainer logs it at the end."""

    main_thread_seconds: float = 0.0
    calls: int = 0
    points_sent: int = 0
    points_skipped_as_logged: int = 0
    lost_contact_events: int = 0
    lost_contact_seconds: float = 0.0
    failed_sends: int = 0
    sender_cpu_seconds: float = 0.0  # CPU time of the sender thread (it competes for the GIL)
    sender_cpu_by_kind: dict[str, float] = field(default_factory=dict)  # the same, by operation kind
    sender_setup_cpu_seconds: float = 0.0  # once per logger: importing mlflow, making the client (not per step)
    coalesced_calls: int = 0  # submitted calls dropped because the same call was already queued
    dropped_ops: int = field(default=0)
    dropped_points: int = 0  # metric points dropped, oldest first, to keep the buffer within max_buffered_points


class RunLogger:
    """Buffered, asynchronous MLflow logging into one run, from one process.

    ``log_metrics``/``set_tags``/``log_params``/``log_artifact``/``set_status`` only enqueue (a few
    microseconds on the caller's thread). A daemon thread sends everything every ``flush_seconds``
    as ``log_batch`` requests; when the server is away it keeps the buffer, retries with backoff,
    says one line on losing and one on regaining contact (``announce``, stderr by default; each names
    the metric points buffered), and tags the run with the time it was lost.
    """

    def __init__(self, uri: str, run_id: str, *, flush_seconds: float = 5.0, max_buffered_points: int = 2_000_000,
                 defer_start: bool = False, announce=None):
        bound_requests()  # fail fast inside each request and retry here: a dead server must not stall the caller
        self.announce = announce or (lambda line: print(line, file=sys.stderr, flush=True))
        self.uri = uri
        self.run_id = run_id
        self.flush_seconds = flush_seconds
        self.max_buffered_points = max_buffered_points
        self.stats = LoggerStats()
        self._ops: collections.deque[_Op] = collections.deque()
        self._metrics: list[tuple[int, float, dict]] = []  # (step, time.time(), {key: value}) not in an op yet
        self._metric_points = 0  # the points in self._metrics
        self._op_points = 0  # the points in metrics ops not sent yet
        self._heads: dict[str, str] = {}  # key -> the start of its points' JSON
        self._steps: collections.deque = collections.deque()  # (step, time.time(), {key: value}), lock-free
        self._tags: dict[str, str] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._closed = False
        self._stopping = threading.Event()  # set by close(): a sender waiting to retry stops instead
        self._client = None
        self._logged_max: dict[str, int] = {}
        self._verified: set[str] = set()
        self._lost_since: float | None = None
        self.fatal: str | None = None  # set when retrying cannot help (credentials refused)
        self._rest: RestSession | None = None  # the REST path of an http(s) server (made on the sender thread)
        self.confirmed_step = -1  # every metric point up to this step has been accepted by the server
        self._go = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="relaunch-mlflow-logger", daemon=True)
        self._thread.start()
        if not defer_start:
            self.start()

    def start(self) -> None:
        """Let the sender thread begin (it imports mlflow: deferred until the first step is done, so a
        restarted worker's first step does not wait for that import)."""
        self._go.set()

    # ---- caller side: enqueue only

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Queue one step's metrics: one append on the caller's thread, expanded by the sender."""
        t0 = time.perf_counter()
        self._steps.append((step, time.time(), metrics))  # the sender makes them ints: less here
        self.stats.calls += 1
        self.stats.main_thread_seconds += time.perf_counter() - t0

    def _enqueue(self, kind: str, payload: Any, *, wake: bool = True) -> None:
        with self._lock:
            self._flush_metrics_into_ops()
            self._ops.append(_Op(kind, payload))
            self._idle.clear()
        if wake:
            self._wake.set()

    def set_tags(self, tags: dict[str, Any]) -> None:
        """Queue tags (values become strings); sent with the next metrics batch, later values winning."""
        with self._lock:
            self._tags.update({k: str(v) for k, v in tags.items()})
            self._idle.clear()

    def log_params(self, params: dict[str, Any]) -> None:
        """Queue params; one already logged with another value becomes tag ``param.<key>.latest``."""
        self._enqueue("params", {k: str(v)[:6000] for k, v in params.items()})

    def log_artifact(self, local_path: str, artifact_path: str | None = None) -> None:
        """Queue a file upload into the run's artifacts."""
        self._enqueue("artifact", (local_path, artifact_path))

    def submit(self, fn) -> None:
        """Queue ``fn(client, run_id)`` to run on the sender thread, in order with everything else
        (for read-then-write updates such as reconciling tags; retried like any other op). A call
        equal to one still waiting in the queue replaces it at the end of the queue: it reads the
        state when it runs, after everything queued before it (one reconciliation per send instead
        of one per checkpoint). It does not wake the sender: it goes out with the next periodic send."""
        with self._lock:
            head = [self._ops.popleft()] if self._ops else []  # the head may be in flight: it stays
            kept = [op for op in self._ops if not (op.kind == "call" and op.payload == fn)]
            self.stats.coalesced_calls += len(self._ops) - len(kept)
            self._ops = collections.deque(head + kept)
        self._enqueue("call", fn, wake=False)  # it goes with the next periodic send (or flush)

    def set_status(self, status: str) -> None:
        """Queue a status change: RUNNING, FINISHED, FAILED or KILLED."""
        self._enqueue("status", status)

    # ---- life cycle

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until everything queued so far was sent, at most ``timeout`` seconds and at most until
        contact has been lost for :data:`WAIT_WHILE_LOST_SECONDS`; False when it was not all sent."""
        with self._lock:
            self._flush_metrics_into_ops()
            if self._ops:
                self._idle.clear()
        self.start()
        self._wake.set()
        deadline = time.monotonic() + timeout
        while not self._idle.wait(max(0.0, min(0.5, deadline - time.monotonic()))):
            lost_since = self._lost_since
            now = time.monotonic()
            if now >= deadline or (lost_since is not None and now - lost_since >= WAIT_WHILE_LOST_SECONDS):
                return False
        return not self.fatal

    def close(self, timeout: float = 30.0) -> bool:
        """Flush, then stop the thread, within ``timeout`` seconds in all; idempotent. Returns whether
        everything was sent. The thread is a daemon: one still importing MLflow or inside a request
        when the time is up is left behind, never waited for beyond ``timeout`` (a worker told to go
        right after its first step must not linger while its logger imports MLflow)."""
        if self._closed:
            return not self.pending()
        deadline = time.monotonic() + timeout
        done = self.flush(timeout)
        self._closed = True
        self._stopping.set()
        self._wake.set()
        self._thread.join(max(0.0, min(2.0, deadline - time.monotonic())))
        if self._rest is not None and not self._thread.is_alive():
            self._rest.close()
        return done

    def pending(self) -> int:
        """Queued operations and metric points not yet sent."""
        with self._lock:
            return len(self._ops) + len(self._metrics) + len(self._steps) + len(self._tags)

    def buffered_points(self) -> int:
        """The metric points queued and not sent yet."""
        with self._lock:
            return self._op_points + self._metric_points + sum(len(entry[2]) for entry in list(self._steps))

    def lost_contact_tags(self) -> dict[str, str]:
        """The ``relaunch.tracking.*`` tags of this logger's outages ({} when it never lost contact)."""
        stats = self.stats
        if not stats.lost_contact_events:
            return {}
        seconds = stats.lost_contact_seconds + (time.monotonic() - self._lost_since if self._lost_since else 0.0)
        return {"relaunch.tracking.lost_contact": "true",
                "relaunch.tracking.lost_contact_seconds": f"{seconds:.1f}",
                "relaunch.tracking.lost_contact_events": str(stats.lost_contact_events),
                "relaunch.tracking.dropped_points": str(stats.dropped_points)}

    @property
    def rest_requests(self) -> int:
        """Requests made through the REST path so far (0 when the server is not http(s))."""
        return self._rest.requests if self._rest is not None else 0

    @property
    def connected(self) -> bool:
        return self._lost_since is None

    # ---- the sender thread

    def _flush_metrics_into_ops(self) -> None:
        """Move the queued steps into a metrics op (caller holds the lock); keeps the queue's order. The
        sender formats them per step, never one tuple per point."""
        while self._steps:
            entry = self._steps.popleft()
            self._metrics.append(entry)
            self._metric_points += len(entry[2])
        self._keep_within_cap()
        if self._metrics or self._tags:
            self._ops.append(_Op("metrics", self._metrics, tags=self._tags or None, points=self._metric_points))
            self._op_points += self._metric_points
            self._metrics, self._metric_points, self._tags = [], 0, {}

    def _keep_within_cap(self) -> None:
        """The server was away long: drop the oldest metric points until every buffered one (queued
        ops and new steps) fits max_buffered_points. The head op may be in flight: it stays."""
        excess = self._metric_points + self._op_points - self.max_buffered_points
        if excess <= 0:
            return
        dropped_before = self.stats.dropped_points
        for at, op in enumerate(list(self._ops)):
            if excess <= 0:
                break
            if at == 0 or op.kind != "metrics":
                continue
            dropped = self._drop_oldest(op.payload, excess)
            op.points -= dropped
            self._op_points -= dropped
            excess -= dropped
            if not op.payload:  # its tags still go out, in its place (a later value of a tag wins)
                self._ops[at] = _Op("tags", op.tags) if op.tags else None
        if None in self._ops:
            self._ops = collections.deque(op for op in self._ops if op is not None)
        self._metric_points -= self._drop_oldest(self._metrics, excess)
        if not dropped_before and self.stats.dropped_points:
            print(f"relaunch: the tracking buffer holds {self.max_buffered_points} metric points: dropping the "
                  "oldest until the server is back (counted in the run's tag relaunch.tracking.dropped_points)",
                  file=sys.stderr)

    def _drop_oldest(self, entries: list[tuple[int, float, dict]], points: int) -> int:
        """Drop the oldest ``entries`` (steps) until at least ``points`` points are gone; the count."""
        dropped = count = 0
        while dropped < points and count < len(entries):
            dropped += len(entries[count][2])
            count += 1
        del entries[:count]
        self.stats.dropped_points += dropped
        return dropped

    def _sent(self, op: _Op) -> None:
        """``op`` leaves the queue, sent or refused (caller holds the lock)."""
        self._ops.popleft()
        self._op_points -= op.points

    def _loop(self) -> None:
        backoff = 0.5
        self._go.wait()
        setup = time.thread_time()
        try:
            import_mlflow("mlflow.utils.rest_utils", "mlflow.utils.credentials")
            remember_absent()
            self.get_client()  # its store and REST modules load on first use: once, not per step
            if self.uri.startswith(("http://", "https://")):
                self._rest = RestSession(self.uri)
        except Exception as err:  # noqa: BLE001 - each send below fails and says why
            print(f"relaunch: importing mlflow: {describe(err)}", file=sys.stderr)
        self.stats.sender_setup_cpu_seconds = time.thread_time() - setup
        while True:
            self._wake.wait(self.flush_seconds)
            self._wake.clear()
            with self._lock:
                self._flush_metrics_into_ops()
            while True:
                with self._lock:
                    op = self._ops[0] if self._ops else None
                if op is None:
                    if not self._metrics and not self._steps and not self._tags:
                        self._idle.set()
                    break
                cpu = time.thread_time()
                try:
                    self._send(op)
                except Exception as err:  # the server is away or answered 5xx: keep the op, retry later
                    if is_auth_error(err) or is_not_found(err):
                        self.fatal = (f"tracking: run {self.run_id} does not exist at {self.uri}"
                                      if not is_auth_error(err) else "tracking: the server refused the "
                                      "credentials; check MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD")
                        self._idle.set()
                        return
                    if is_rejected(err):  # the server answered and refused this op: retrying cannot help
                        print(f"relaunch: tracking server rejected a {op.kind} update: {describe(err)}",
                              file=sys.stderr)
                        self.stats.dropped_ops += 1
                        with self._lock:
                            self._sent(op)
                        continue
                    self._lost(err)
                    op.attempts += 1
                    if self._closed:
                        return
                    with self._lock:  # what the training logs meanwhile stays within the cap
                        self._flush_metrics_into_ops()
                    if self._stopping.wait(backoff):  # closed while away: what is left is the caller's
                        return
                    backoff = min(backoff * 2, 5.0)
                    continue
                backoff = 0.5
                spent = time.thread_time() - cpu
                self.stats.sender_cpu_seconds += spent
                self.stats.sender_cpu_by_kind[op.kind] = self.stats.sender_cpu_by_kind.get(op.kind, 0.0) + spent
                with self._lock:
                    self._sent(op)
                self._regained(op.points)
            if self._closed:
                return

    def _lost(self, err: Exception) -> None:
        self.stats.failed_sends += 1
        self._verified.clear()  # a failed request may still have been applied: ask again before resending
        if self._lost_since is None:
            self._lost_since = time.monotonic()
            self.stats.lost_contact_events += 1
            self.announce(f"relaunch: lost contact with the tracking server {self.uri} ({describe(err)}); "
                          f"buffering metric points ({self.buffered_points()} so far) and retrying")

    def _regained(self, sent_points: int) -> None:
        """A send succeeded: after an outage, one line with the points it buffered, and the outage's tags."""
        if self._lost_since is None:
            return
        gone = time.monotonic() - self._lost_since
        self._lost_since = None
        self.stats.lost_contact_seconds += gone
        self.announce(f"relaunch: tracking server {self.uri} back after {gone:.1f}s; sending the "
                      f"{sent_points + self.buffered_points()} metric points buffered meanwhile")
        with self._lock:
            self._ops.appendleft(_Op("tags", self.lost_contact_tags()))

    def get_client(self):
        """This logger's MlflowClient (made on first use)."""
        if self._client is None:
            self._client = tracking_client(self.uri)
        return self._client

    def _send(self, op: _Op) -> None:
        client = self.get_client()
        if op.kind == "metrics":
            self._send_metrics(client, op)
        elif op.kind == "tags":
            if self._rest is not None:
                items = list(op.payload.items())
                for i in range(0, len(items), TAGS_PER_REQUEST):
                    self._post_batch("", dict(items[i:i + TAGS_PER_REQUEST]))
                return
            from mlflow.entities import RunTag

            client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in op.payload.items()])
        elif op.kind == "params":
            if self._rest is not None:
                self._rest_params(op.payload)
            else:
                log_new_params(client, self.run_id, op.payload)
        elif op.kind == "artifact":
            client.log_artifact(self.run_id, op.payload[0], op.payload[1])
        elif op.kind == "call":
            op.payload(client, self.run_id)
        elif op.kind == "status":
            if self._rest is not None:
                self._rest_status(op.payload)
            else:
                set_run_status(client, self.run_id, op.payload)

    def _last_steps(self, client, keys: set[str]) -> None:
        """The highest step the server holds of each of ``keys``. Over REST one ``runs/get`` answers
        for every key (a run's latest metric is its highest step, in every MLflow store); a local
        store is asked per key."""
        if self._rest is not None:
            data = self._rest.get(GET_RUN, run_id=self.run_id).get("run", {}).get("data", {})
            held = {m["key"]: int(m.get("step", 0)) for m in data.get("metrics", [])}
            for key in keys:
                self._logged_max[key] = held.get(key, -1)
        else:
            for key in keys:
                history = client.get_metric_history(self.run_id, key)
                self._logged_max[key] = max((m.step for m in history), default=-1)
        self._verified |= keys

    def _send_metrics(self, client, op: _Op) -> None:
        """Send a metrics op: its steps (``(step, time.time(), {key: value})``), less what the server holds,
        in requests of at most 1000 points (the op's tags ride in the last one)."""
        entries: list[tuple[int, float, dict]] = op.payload
        merged: dict[int, tuple[int, dict]] = {}  # one point per (key, step): the last one queued wins
        for step, stamp, metrics in entries:
            step, stamp = int(step), int(stamp * 1000)
            if step in merged:
                merged[step] = (stamp, {**merged[step][1], **metrics})
            else:
                merged[step] = (stamp, metrics)
        keys = set().union(*(m for _, m in merged.values())) if merged else set()
        if keys - self._verified:
            self._last_steps(client, keys - self._verified)
        if keys - self._heads.keys():
            self._heads.update({k: '{"key":' + json.dumps(k) + ',"value":' for k in keys - self._heads.keys()})
        logged = self._logged_max
        high = max(logged.values(), default=-1)  # steps above it: no key of theirs is on the server yet
        chunks: list[tuple[list, dict[str, int], int]] = []  # (points, key -> its highest step there, count)
        parts: list = []
        highest: dict[str, int] = {}
        count = 0
        for step in sorted(merged):
            stamp, metrics = merged[step]
            if step <= high:
                kept = {k: v for k, v in metrics.items() if step > logged.get(k, -1)}
                self.stats.points_skipped_as_logged += len(metrics) - len(kept)
                metrics = kept
            if not metrics:  # all held by the server already, or an empty call
                continue
            if count + len(metrics) <= _BATCH:  # the whole step fits in this request: the usual case
                if self._rest is not None:
                    parts.append(self._format(metrics, stamp, step))
                else:
                    parts.extend((k, float(v), stamp, step) for k, v in metrics.items())
                count += len(metrics)
                highest.update(dict.fromkeys(metrics, step))  # steps ascend: the last is the highest
                if count == _BATCH:
                    chunks.append((parts, highest, count))
                    parts, highest, count = [], {}, 0
                continue
            items = list(metrics.items())
            while items:
                taken, items = items[:_BATCH - count], items[_BATCH - count:]
                if self._rest is not None:
                    parts.append(self._format(dict(taken), stamp, step))
                else:
                    parts.extend((k, float(v), stamp, step) for k, v in taken)
                count += len(taken)
                highest.update(dict.fromkeys([k for k, _ in taken], step))  # steps ascend: the last is the highest
                if count == _BATCH:
                    chunks.append((parts, highest, count))
                    parts, highest, count = [], {}, 0
        if count or not chunks:
            chunks.append((parts, highest, count))
        if op.tags and chunks[-1][2] + len(op.tags) > _BATCH:  # the server counts tags in the same limit
            chunks.append(([], {}, 0))
        for n, (chunk, sent, count) in enumerate(chunks):
            tags = op.tags if n == len(chunks) - 1 else None
            if self._rest is not None:
                self._post_batch(",".join(chunk), tags)
            else:
                from mlflow.entities import Metric, RunTag

                client.log_batch(self.run_id, metrics=[Metric(k, v, t, s) for k, v, t, s in chunk],
                                 tags=[RunTag(k, v) for k, v in (tags or {}).items()])
            self.stats.points_sent += count
            for key, step in sent.items():  # a later chunk that fails is resent less what these hold
                if step > logged.get(key, -1):
                    logged[key] = step
        self.confirmed_step = max(self.confirmed_step, max(merged, default=-1))

    def _format(self, metrics: dict, stamp: int, step: int) -> str:
        """One step's points as the JSON of ``runs/log-batch``. When every value is finite (their sum
        is), ``repr`` of each float is its JSON; NaN and infinities are strings there."""
        heads = self._heads  # every key's is made before (_send_metrics)
        tail = f',"timestamp":{stamp},"step":{step}}}'
        values = list(map(float, metrics.values()))
        if -_FINITE <= sum(values) <= _FINITE:
            return ",".join([f"{heads[k]}{v!r}{tail}" for k, v in zip(metrics, values)])
        return ",".join([f"{heads[k]}{_json_number(v)}{tail}" for k, v in zip(metrics, values)])

    def _post_batch(self, points: str, tags: dict[str, str] | None, params: dict[str, str] | None = None) -> None:
        """``runs/log-batch`` with ``points`` (JSON objects, comma-separated) made here: the client's
        entity -> protobuf -> JSON path costs ~30 us a point, and this thread shares the GIL with the
        training loop."""
        tag_list = json.dumps([{"key": k, "value": v} for k, v in (tags or {}).items()])
        extra = f',"params":{json.dumps([{"key": k, "value": v} for k, v in params.items()])}' if params else ""
        self._rest.post(LOG_BATCH, f'{{"run_id":{json.dumps(self.run_id)},"metrics":[{points}],'
                                          f'"tags":{tag_list}{extra}}}')

    def _rest_params(self, params: dict[str, str]) -> None:
        """:func:`~relaunch.components.core.tracking.client.log_new_params` over REST: the params the run does
        not hold yet; one it holds with another value becomes the tag ``param.<key>.latest``."""
        from .client import PARAMS_PER_REQUEST

        data = self._rest.get(GET_RUN, run_id=self.run_id).get("run", {}).get("data", {})
        existing = {p["key"]: p.get("value", "") for p in data.get("params", [])}
        new = [(k, v) for k, v in params.items() if k not in existing]
        changed = {f"param.{k}.latest": v for k, v in params.items() if k in existing and existing[k] != v}
        for i in range(0, len(new), PARAMS_PER_REQUEST):
            self._post_batch("", None, dict(new[i:i + PARAMS_PER_REQUEST]))
        items = list(changed.items())
        for i in range(0, len(items), TAGS_PER_REQUEST):
            self._post_batch("", dict(items[i:i + TAGS_PER_REQUEST]))

    def _rest_status(self, status: str) -> None:
        """:func:`~relaunch.components.core.tracking.client.set_run_status` over REST (``runs/update``): RUNNING
        reopens the run, a terminal status ends it now."""
        from .client import STATUSES

        if status not in STATUSES:
            raise ValueError(f"run status {status!r} is not one of {', '.join(STATUSES)}")
        body: dict[str, Any] = {"run_id": self.run_id, "status": status}
        if status != "RUNNING":
            body["end_time"] = int(time.time() * 1000)
        self._rest.post(UPDATE_RUN, body)
