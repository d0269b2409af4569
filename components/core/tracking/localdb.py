"""The embedded MLflow database of a local run (``tracking.uri: sqlite:///...``).

SQLite's default journal syncs the disk several times per transaction; MLflow creates its schema in
some sixty migrations and every step writes a handful of rows, so on a busy disk a local run spent
seconds waiting on fsync. In write-ahead-log mode with ``synchronous=NORMAL`` a commit appends to
the log and the disk is synced at checkpoints: a crash of a process loses nothing committed, a
power cut at most the last transactions of a local experiment. Servers (PostgreSQL, MySQL, an
MLflow server) are untouched.
"""

from __future__ import annotations

_installed = False


def use_write_ahead_log() -> None:
    """Open every SQLite connection of this process in WAL mode with ``synchronous=NORMAL``; idempotent."""
    global _installed
    if _installed:
        return
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    @event.listens_for(Engine, "connect")
    def _write_ahead_log(connection, _record) -> None:
        if type(connection).__module__.startswith("sqlite3"):
            cursor = connection.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA synchronous=NORMAL")
            cursor.close()

    _installed = True
