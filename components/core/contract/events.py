"""The one event schema processes tell each other what happens with: kinds as an enum, one writer
(:func:`write`) and one reader (:func:`read`).

Who writes what, and where it goes:

- the pipeline's steps (:mod:`relaunch.pipelines.kfp_entry`, :mod:`relaunch.pipelines.local.kfp_fixes`): ``step-start``,
  ``step-end``, ``attempt-end``, ``retry`` (and ``tracking``, from a step's calls to MLflow), appended
  to the run's event file (``$RELAUNCH_EVENTS``, one JSON object a line, which ``relaunch run`` sets
  and :mod:`relaunch.pipelines.local.console` tails);
- the training's rank 0 (:mod:`relaunch.components.train` and its helpers): ``resumed``, ``first-step``,
  ``progress``, ``saving``, ``summary``, ``exit``, ``tracking``, ``store``, printed on stdout as
  ``RELAUNCH_EVENT {json}``; the local launcher reads its workers' output with :func:`read` and
  passes every event on to the event file.

Each event is ``{"kind": ..., "time": <epoch seconds>, **fields}``; the same JSON in both places.
"""

from __future__ import annotations

import enum
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

EVENTS_ENV = "RELAUNCH_EVENTS"
"""The environment variable naming the run's event file (set by ``relaunch run``)."""
MARKER = "RELAUNCH_EVENT "
"""What starts an event on a process's output (anything before it, such as torchrun's prefix, is ignored)."""


class Kind(str, enum.Enum):
    """Every kind of event; the value is what the JSON carries."""

    STEP_START = "step-start"  # step; warm
    STEP_END = "step-end"  # step, exit_code; outputs (0) or message
    ATTEMPT_END = "attempt-end"  # step, exit_code: one run of a step's process ended (kfp.local)
    RETRY = "retry"  # step, attempt, limit, exit_code, delay
    RESUMED = "resumed"  # attempt, step (-1: from scratch), uri, world_size
    FIRST_STEP = "first-step"  # attempt, step, phases: start-up phase -> seconds after the worker's first line
    PROGRESS = "progress"  # attempt, step, total_steps, loss, epoch
    SAVING = "saving"  # attempt, step: a checkpoint of that step is being written
    SUMMARY = "summary"  # the attempt's TrainSummary
    EXIT = "exit"  # exit_code, reason: how rank 0 ended, printed even when the store is away
    WAITING = "waiting"  # line: what a process waits for and for how long at most (a live writer's lease)
    TRACKING = "tracking"  # line: the tracking server lost, back (with the points buffered), or a failed try
    STORE = "store"  # line: a checkpoint not saved because the store cannot be written, or writable again


@dataclass(frozen=True)
class Event:
    """One event: its kind, when it happened, and the fields of its kind."""

    kind: Kind
    time: float
    fields: dict[str, Any] = field(default_factory=dict)

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    def __getitem__(self, key: str) -> Any:
        return self.fields[key]

    def to_json(self) -> str:
        return json.dumps({"kind": self.kind.value, "time": self.time, **self.fields}, sort_keys=True, default=str)


def write(kind: Kind, to: str | os.PathLike | TextIO | None = None, **fields: Any) -> Event:
    """Write one event of ``kind`` with ``fields``; returns it.

    Args:
        to: a text stream (the event is one ``RELAUNCH_EVENT {json}`` line on it, flushed: how the
            training talks to its launcher), a path (one JSON line appended: the run's event file),
            or None: the file ``$RELAUNCH_EVENTS`` names, nothing when it is unset.
    """
    event = Event(Kind(kind), fields.pop("time", None) or time.time(), fields)
    if to is None:
        to = os.environ.get(EVENTS_ENV) or None
        if to is None:
            return event
    if hasattr(to, "write"):
        to.write(MARKER + event.to_json() + "\n")  # one write: a line another thread cannot split
        to.flush()
    else:
        with open(to, "a") as fh:
            fh.write(event.to_json() + "\n")
    return event


def read(line: str) -> Event | None:
    """The event of one line (a line of the event file, or a ``RELAUNCH_EVENT`` line of a process's
    output); None for a line that is no event (other output, a half-written line, an unknown kind)."""
    at = line.find(MARKER)
    text = line[at + len(MARKER):] if at >= 0 else line
    if not text.lstrip().startswith("{"):
        return None
    try:
        data = json.loads(text)
        kind = Kind(data.pop("kind"))
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    when = data.pop("time", 0.0)
    return Event(kind, float(when) if isinstance(when, (int, float)) else 0.0, data)


def read_file(path: str | Path, offset: int = 0) -> tuple[list[Event], int]:
    """The events of the file at ``path`` from byte ``offset`` on, and the offset after the last
    complete line (a line still being written is left for the next call)."""
    found: list[Event] = []
    with open(path) as fh:
        fh.seek(offset)
        while True:
            line = fh.readline()
            if not line.endswith("\n"):
                break
            offset = fh.tell()
            event = read(line)
            if event is not None:
                found.append(event)
    return found, offset


def emit(kind: Kind, **fields: Any) -> Event:
    """The training's rank 0: one event on stdout for its launcher (:func:`write` to ``sys.stdout``)."""
    return write(kind, sys.stdout, **fields)
