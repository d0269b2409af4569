"""Who holds a record of the store (a write lease, a pipeline lock): whether the process that wrote it
still runs, when it ran on this host. One rule for every record that names a process."""

from __future__ import annotations

import os
import socket


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


def _stat_fields(pid: int) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` after the command name (state first); [] when unknown."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def process_start(pid: int) -> str:
    """The start time of process ``pid`` in clock ticks since boot, "" when unknown."""
    fields = _stat_fields(pid)
    return fields[19] if len(fields) > 19 else ""


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
    fields = _stat_fields(pid)
    if fields and fields[0] in ("Z", "X"):
        return False
    return not started or not fields or process_start(pid) == started
