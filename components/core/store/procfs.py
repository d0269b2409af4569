"""Processes as Linux's ``/proc`` shows them: a process's ``stat`` fields and the clock they are told
by. One reader for every part that asks about a process (a record's holder, the agents that wait for
their workers, the Ray head's group, the local run's orphans)."""

from __future__ import annotations

import os
from typing import Iterator


def stat_fields(pid: int | str) -> list[bytes] | None:
    """The fields of ``/proc/<pid>/stat`` after the command's parentheses (so index 0 is field 3,
    the state; ``proc(5)``'s field N is index N - 3), or None when the process is gone or there is no
    ``/proc``. The command is skipped by its last ``)``: it may hold spaces and parentheses."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None


def processes() -> Iterator[tuple[int, list[bytes]]]:
    """``(pid, stat_fields(pid))`` of every process ``/proc`` lists now (none without ``/proc``; one that
    ends while the listing is read is left out)."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return
    for entry in entries:
        if entry.isdigit() and (fields := stat_fields(entry)) is not None:
            yield int(entry), fields


def boot_ticks() -> int:
    """Clock ticks since boot now (the unit of a process's start time, field 22 of its ``stat``)."""
    with open("/proc/uptime") as f:
        return int(float(f.read().split()[0]) * os.sysconf("SC_CLK_TCK"))


def exited(fields: list[bytes] | None) -> bool:
    """Whether the process of ``fields`` (:func:`stat_fields`) is gone or has exited and waits to be
    reaped (a zombie: it holds nothing any more, and its parent may take seconds to reap it)."""
    return fields is None or fields[0] in (b"Z", b"X")
