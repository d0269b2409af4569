"""The validation metrics of a training as text lines in a local file: the one channel a tuner reads a
trial's intermediate values from (``relaunch tune``'s pruner, Katib's File metrics collector in TEXT
format). One writer (:func:`write_validation`, rank 0 after each validation) and one reader
(:func:`parse_line`, :func:`read_new`).

When ``RELAUNCH_METRICS_FILE`` names a file, rank 0 appends one line per validation, flushed::

    step=40 val_accuracy=0.9133 val_loss=0.3412

``name=value`` pairs separated by spaces, ``step`` first, the metrics sorted by name: what Katib's
TEXT collector parses (its default filter ``([\\w|-]+)\\s*=\\s*([+-]?\\d*(\\.\\d+)?([Ee][+-]?\\d+)?)``).
A step can appear twice (a resumed attempt validates a step its killed predecessor had validated but
not committed); the values are equal, the training being deterministic, and a reader keeps the first.
Nothing is written when the variable is unset.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

METRICS_FILE_ENV = "RELAUNCH_METRICS_FILE"
"""The environment variable naming the file rank 0 appends its validation lines to."""


def format_line(step: int, metrics: dict[str, float]) -> str:
    """``step=40 val_accuracy=0.9133 val_loss=0.3412`` (each value the shortest text that reads back as
    the same float; a non-finite value is left out: no collector parses it)."""
    pairs = " ".join(f"{name}={float(value)!r}" for name, value in sorted(metrics.items())
                     if isinstance(value, (int, float)) and math.isfinite(float(value)))
    return f"step={int(step)} {pairs}".rstrip()


def write_validation(step: int, metrics: dict[str, float], path: str | None = None) -> None:
    """Append the validation ``metrics`` of ``step`` to the file ``path`` names (default: the one
    ``$RELAUNCH_METRICS_FILE`` names; nothing when neither is set), one line, flushed to the OS."""
    path = path or os.environ.get(METRICS_FILE_ENV)
    if not path:
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fh.write(format_line(step, metrics) + "\n")  # one write: a reader never sees half a line's pairs


def parse_line(line: str) -> tuple[int, dict[str, float]] | None:
    """``(step, {name: value})`` of one line, None for a line that is not one (no ``step=``, half written)."""
    values: dict[str, float] = {}
    step = None
    for pair in line.split():
        name, sep, text = pair.partition("=")
        if not sep:
            return None
        try:
            if name == "step":
                step = int(text)
            else:
                values[name] = float(text)
        except ValueError:
            return None
    return (step, values) if step is not None else None


def read_new(path: str | os.PathLike, offset: int = 0) -> tuple[list[tuple[int, dict[str, float]]], int]:
    """The validations of the file at ``path`` from byte ``offset`` on, and the offset after the last
    complete line (a line still being written waits for the next call); ``([], offset)`` while the file
    does not exist."""
    found: list[tuple[int, dict[str, float]]] = []
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            data = fh.read()
    except FileNotFoundError:
        return found, offset
    end = data.rfind(b"\n") + 1
    for line in data[:end].decode(errors="replace").splitlines():
        parsed = parse_line(line)
        if parsed is not None:
            found.append(parsed)
    return found, offset + end
