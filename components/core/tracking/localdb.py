"""The embedded MLflow database of a local run (``tracking.uri: sqlite:///...``).

SQLite's default journal syncs the disk several times per transaction; MLflow creates its schema in
some sixty migrations and every step writes a handful of rows, so on a busy disk a local run spent
seconds waiting on fsync. In write-ahead-log mode with ``synchronous=NORMAL`` a commit appends to
the log and the disk is synced at checkpoints: a crash of a process loses nothing committed, a
power cut at most the last transactions of a local experiment. Servers (PostgreSQL, MySQL, an
MLflow server) are untouched.

Those sixty migrations also cost ~2 s of CPU each time a new database is made (every training or study
in a folder of its own). :func:`seed_new_database` makes it a copy of an empty one instead: the first
database this MLflow version made on the machine, kept in the user's cache (``$XDG_CACHE_HOME/relaunch``,
else ``~/.cache/relaunch``). The copy is what MLflow would have made, its Default experiment's artifact
folder included (``./mlruns/0`` of the process that makes it, as MLflow writes it); when the cache cannot
be written, or the empty database is not what this module expects, MLflow makes the database as before.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import tempfile
import uuid
from pathlib import Path

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


DEFAULT_ARTIFACTS = "mlruns"
"""The folder, relative to the working directory, of a new database's Default experiment (experiment 0):
MLflow's default artifact root for a client that names none."""


SIDE_FILES = ("-wal", "-shm", "-journal")
"""What SQLite keeps beside a database: left by one that was deleted, they are not ours to remove."""


def default_experiment_folder() -> str:
    """The Default experiment's folder MLflow writes into a database it makes in this working directory."""
    return os.path.join(os.path.abspath(DEFAULT_ARTIFACTS), "0")


def database_path(uri: str) -> Path | None:
    """The file of a ``sqlite:///`` tracking URI (relative to the working directory as SQLAlchemy reads
    it); None for an in-memory database or another scheme."""
    if not uri.startswith("sqlite:///"):
        return None
    path = uri.removeprefix("sqlite:///").split("?", 1)[0]
    return None if not path or path == ":memory:" else Path(path)


def seed_new_database(uri: str) -> bool:
    """Make the database of ``uri`` a copy of the cached empty one when it does not exist yet (its folder
    does); True when this call made it. Another process making it at the same moment wins or loses as a
    whole: the copy appears complete, under its name, or not at all."""
    path = database_path(uri)
    if path is None or path.exists() or not path.parent.is_dir():
        return False
    if any(Path(f"{path}{suffix}").exists() for suffix in SIDE_FILES):
        return False  # a deleted database's log: SQLite would replay it into the copy
    empty = _empty_database()
    if empty is None:
        return False
    artifacts = default_experiment_folder()
    partial = path.parent / f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    try:
        os.close(os.open(partial, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))  # the mode MLflow's file gets
        _copy(empty, partial, artifacts)
        os.link(partial, path)  # fails if it appeared meanwhile: that one stands
        return True
    except (OSError, sqlite3.Error):
        return False
    finally:
        with contextlib.suppress(OSError):
            os.unlink(partial)


def _copy(source: Path, target: Path, artifacts: str) -> None:
    """``source`` into ``target`` (sqlite's online backup: a consistent copy), the Default experiment's
    artifact folder set to ``artifacts``."""
    with contextlib.closing(sqlite3.connect(source)) as src, contextlib.closing(sqlite3.connect(target)) as dst:
        src.backup(dst)
        dst.execute("UPDATE experiments SET artifact_location = ? WHERE experiment_id = 0", (artifacts,))
        dst.commit()


def cache_folder() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "relaunch"


def _empty_database() -> Path | None:
    """The cached empty database of this MLflow version, made on first use; None when it cannot be made
    here, or holds what this module does not expect (one Default experiment whose artifact folder is
    ``./mlruns/0`` of this process's working directory)."""
    import mlflow

    cache = cache_folder()
    empty = cache / f"mlflow-{mlflow.__version__}-empty.db"
    if empty.exists():
        return empty
    try:
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as work:
            made = Path(work, "made.db")
            _made_by_mlflow(made)
            with contextlib.closing(sqlite3.connect(made)) as db:
                rows = db.execute("SELECT experiment_id, artifact_location FROM experiments").fetchall()
            if rows != [(0, default_experiment_folder())]:
                return None
            _copy(made, Path(work, "empty.db"), "")
            with contextlib.suppress(FileExistsError):  # another process made it first: the same content
                os.link(Path(work, "empty.db"), empty)
    except Exception:  # noqa: BLE001 - any failure here: MLflow makes the database itself, and says why if it cannot
        return None
    return empty


def _made_by_mlflow(path: Path) -> None:
    """A new database made by MLflow itself (its Default experiment's folder: ``./mlruns/0`` of this
    process's working directory)."""
    from mlflow.tracking import MlflowClient

    MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments(max_results=1)
