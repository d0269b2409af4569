"""Log lines a cluster's log store can query: ``logging.format: json`` makes every relaunch process write
one JSON object a line on stderr, labelled with the training, the attempt, the rank, the node and the step.

    {"time": "2026-12-04T03:20:01.123Z", "level": "info", "logger": "stderr", "message": "relaunch: ...",
     "training_id": "relaunch-3f9a1c2e", "attempt": 2, "rank": 0, "node": "worker-1", "node_rank": 1,
     "role": "worker", "step": 120}

:func:`configure` is called once at the start of a process (each step's CLI and KFP entry, each torchrun
worker, and the container supervisor of the torchrun agent, which passes the agent's stderr through
:func:`relay`): it points the stdlib ``logging`` root at a JSON formatter and wraps ``sys.stderr`` so that a
``print(..., file=sys.stderr)``, a warning or a traceback becomes JSON lines too. It exports
``RELAUNCH_LOG_FORMAT`` and ``RELAUNCH_TRAINING_ID``, so the processes it starts (torchrun agents and
their workers, which inherit the environment) log the same way even before they read the configuration.

The fields: ``training_id`` is ``<name>-<8 hex digits of the store URI>`` (the same in every process of
one training, and few enough values to be a Loki label); ``attempt`` is torchrun's restart count + 1
(``TORCHELASTIC_RESTART_COUNT``) in a worker, else ``RELAUNCH_ATTEMPT`` or 1; ``rank`` is ``RANK`` (null
outside the workers); ``node`` the host name and ``node_rank`` ``GROUP_RANK``; ``step`` the last step
:func:`set_step` was told (null before the first, and in the steps).

Not covered: bytes a worker writes to file descriptor 2 below Python (C++ warnings of torch's c10d, a
``faulthandler`` stack dump of the hang watchdog) stay plain text, unless the supervisor relays them (in a
container it does); and a torchrun agent started without the supervisor (``relaunch run`` on a laptop)
writes plain text. A log pipeline should keep unparsable lines as ``message`` (promtail's ``json`` stage
and Filebeat's ``ndjson`` parser do).
"""

from __future__ import annotations

import datetime
import hashlib
import io
import json
import logging
import os
import socket
import sys
import threading
from typing import Any

LOG_FORMAT_ENV = "RELAUNCH_LOG_FORMAT"
TRAINING_ID_ENV = "RELAUNCH_TRAINING_ID"
ROLE_ENV = "RELAUNCH_LOG_ROLE"
FORMATS = ("text", "json")

_step: int | None = None
_role = "process"


def training_id(config) -> str:
    """``<config.name>-<8 hex digits of the store URI>``: one value per training, in every process."""
    return f"{config.name}-{hashlib.sha256(config.store.uri.encode()).hexdigest()[:8]}"


def set_step(step: int) -> None:
    """The training's current step, carried by every later line of this process (the loop calls it)."""
    global _step
    _step = int(step)


def _int_env(name: str) -> int | None:
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return None


def fields() -> dict[str, Any]:
    """The labels of a line logged now."""
    restarts = _int_env("TORCHELASTIC_RESTART_COUNT")
    return {"training_id": os.environ.get(TRAINING_ID_ENV, ""),
            "attempt": restarts + 1 if restarts is not None else (_int_env("RELAUNCH_ATTEMPT") or 1),
            "rank": _int_env("RANK"), "node": socket.gethostname(), "node_rank": _int_env("GROUP_RANK"),
            "role": _role, "step": _step}


def json_line(level: str, logger: str, message: str, **extra: Any) -> str:
    """One log line as JSON (no newline)."""
    now = datetime.datetime.now(datetime.timezone.utc)
    record = {"time": now.strftime("%Y-%m-%dT%H:%M:%S.") + f"{now.microsecond // 1000:03d}Z", "level": level,
              "logger": logger, "message": message, **fields(), **extra}
    return json.dumps(record, default=str)


class JsonFormatter(logging.Formatter):
    """A stdlib ``logging`` record as one JSON line (an exception's traceback in ``exc_info``)."""

    def format(self, record: logging.LogRecord) -> str:
        extra = {"exc_info": self.formatException(record.exc_info)} if record.exc_info else {}
        return json_line(record.levelname.lower(), record.name, record.getMessage(), **extra)


class JsonLines(io.TextIOBase):
    """A text stream that writes each line written to it as one JSON line to ``target``."""

    def __init__(self, target, logger: str = "stderr"):
        super().__init__()
        self.target, self.logger = target, logger
        self._pending = ""
        self._lock = threading.Lock()

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        with self._lock:
            self._pending += text
            *lines, self._pending = self._pending.split("\n")
            for line in lines:
                if line.strip():
                    self.target.write(json_line("info", self.logger, line) + "\n")
            if lines:
                self.target.flush()
        return len(text)

    def flush(self) -> None:
        with self._lock:
            if self._pending.strip():
                self.target.write(json_line("info", self.logger, self._pending) + "\n")
            self._pending = ""
            self.target.flush()

    def fileno(self) -> int:  # faulthandler and subprocess write below Python: plain text there
        return self.target.fileno()

    def isatty(self) -> bool:
        return False

    @property
    def encoding(self) -> str:
        return getattr(self.target, "encoding", "utf-8")


def relay(source, *, to=None) -> threading.Thread:
    """Copy a child's stderr (a binary pipe) to ours on a daemon thread: a JSON line as it is (a
    worker's), any other line (torchrun's agent, a C++ warning) wrapped as one. Returns the thread."""
    target = to or (sys.stderr.target if isinstance(sys.stderr, JsonLines) else sys.stderr)

    def pump() -> None:
        for raw in iter(source.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            if not line.strip():
                continue
            try:
                is_json = isinstance(json.loads(line), dict)
            except ValueError:
                is_json = False
            target.write((line if is_json else json_line("info", "stderr", line)) + "\n")
            target.flush()

    thread = threading.Thread(target=pump, name="relaunch-log-relay", daemon=True)
    thread.start()
    return thread


def log_format(config=None) -> str:
    """``config.logging.format``; without a configuration, ``RELAUNCH_LOG_FORMAT`` (what a parent chose)."""
    chosen = config.logging.format if config is not None else os.environ.get(LOG_FORMAT_ENV, "text")
    return chosen if chosen in FORMATS else "text"


def configure(config=None, *, role: str) -> str:
    """Configure this process's logging from ``config`` (or the environment a parent exported); returns
    the format. Idempotent; ``role`` names the process in every line (a step's name, ``worker``)."""
    global _role
    _role = role
    fmt = log_format(config)
    os.environ[LOG_FORMAT_ENV] = fmt
    if config is not None:
        os.environ[TRAINING_ID_ENV] = training_id(config)
    if fmt != "json":
        return fmt
    if not isinstance(sys.stderr, JsonLines):
        sys.stderr = JsonLines(sys.stderr)
    real = sys.stderr.target
    handler = logging.StreamHandler(real)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    logging.captureWarnings(True)
    return fmt
