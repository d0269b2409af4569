"""A process's ``/proc/<pid>/stat`` as fields (Linux), read by the agents that wait for processes."""

from __future__ import annotations


def stat_fields(pid: int | str) -> list[bytes] | None:
    """The fields of ``/proc/<pid>/stat`` after the command's parentheses (so index 0 is field 3,
    the state; ``proc(5)``'s field N is index N - 3), or None when the process is gone or there is no
    ``/proc``. The command is skipped by its last ``)``: it may hold spaces and parentheses."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
