"""Who holds a record of the store (a write lease, a pipeline lock): whether the process that wrote it
still runs, when it ran on this host. One rule for every record that names a process."""

from __future__ import annotations

import os
import socket

from .procfs import exited, stat_fields


def pid_namespace() -> str:
    """This process's pid namespace (a container has its own: a pid means nothing across them)."""
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return ""


def on_this_host(record: dict) -> bool:
    """Whether ``record``'s ``pid`` names a process this one can see (same host, same pid namespace)."""
    return (record.get("host") == socket.gethostname() and record.get("pid_namespace") == pid_namespace()
            and isinstance(record.get("pid"), int))


def process_start(pid: int) -> str:
    """The start time of process ``pid`` in clock ticks since boot, "" when unknown."""
    return _start(stat_fields(pid))


def _start(fields: list[bytes] | None) -> str:
    return fields[19].decode() if fields is not None and len(fields) > 19 else ""


def process_running(pid: int, started: str = "") -> bool:
    """Whether process ``pid`` runs: it exists, is not a zombie (killed, waiting to be reaped: it holds
    nothing any more, and its parent may take seconds to reap it), and, when ``started`` is given, it
    is the process that started then (not a later one that reuses the pid)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    fields = stat_fields(pid)
    if fields is not None and exited(fields):
        return False
    return not started or fields is None or _start(fields) == started
