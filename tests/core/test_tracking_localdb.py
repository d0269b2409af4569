"""A new local MLflow database (components/core/tracking/localdb.py) is a copy of an empty one this MLflow
version made once: the same schema, migrations and rows as the database MLflow makes itself in the same
folder, never written over one that exists, and left to MLflow when the cache cannot be written."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from relaunch.components.core.tracking.client import client
from relaunch.components.core.tracking.localdb import cache_folder, seed_new_database

TIMES = ("creation_time", "last_update_time", "start_time", "end_time")


def _content(path: Path) -> dict:
    """Every table's definition and rows (the moments a row was made left out; the database's folder
    written as ``<here>``)."""
    with sqlite3.connect(path) as db:
        tables = [(name, sorted(line.strip().rstrip(",") for line in (sql or "").splitlines()))  # clauses in any order:
                  for name, sql in db.execute("SELECT name, sql FROM sqlite_master "  # alembic's differ per process
                                              "WHERE type IN ('table', 'index') ORDER BY name")]
        rows = {}
        for (name, _) in tables:
            if db.execute("SELECT type FROM sqlite_master WHERE name = ?", (name,)).fetchone()[0] != "table":
                continue
            columns = [c[1] for c in db.execute(f'PRAGMA table_info("{name}")')]
            kept = [c for c in columns if c not in TIMES]
            found = db.execute(f'SELECT {", ".join(kept)} FROM "{name}"').fetchall()
            rows[name] = sorted((tuple(v.replace(str(path.parent), "<here>") if isinstance(v, str) else v for v in row)
                                 for row in found), key=repr)
    return {"tables": tables, "rows": rows}


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_a_new_local_database_is_what_mlflow_makes_in_the_same_folder(tmp_path, monkeypatch, cache):
    from mlflow.tracking import MlflowClient

    first, made, seeded = tmp_path / "first", tmp_path / "made", tmp_path / "seeded"
    for folder in (first, made, seeded):
        folder.mkdir()
    monkeypatch.chdir(first)  # absolute URIs: MLflow keeps a store per URI in a process, a relative one too
    assert seed_new_database(f"sqlite:///{first}/mlflow.db")  # the empty one is made, in this folder, and kept
    assert list(cache_folder().glob("mlflow-*-empty.db"))
    monkeypatch.chdir(seeded)
    assert seed_new_database(f"sqlite:///{seeded}/mlflow.db")  # a copy of it, in another folder
    assert [p.name for p in seeded.iterdir() if p.name.startswith(".")] == []  # no partial copy left beside it
    monkeypatch.chdir(made)
    MlflowClient(tracking_uri=f"sqlite:///{made}/mlflow.db").search_experiments()  # MLflow makes this one itself

    ours, theirs = _content(seeded / "mlflow.db"), _content(made / "mlflow.db")
    assert ours["tables"] == theirs["tables"]
    assert {t: r for t, r in ours["rows"].items() if r != theirs["rows"][t]} == {}
    assert (seeded / "mlflow.db").stat().st_mode == (made / "mlflow.db").stat().st_mode

    mlflow_client = client(f"sqlite:///{seeded}/mlflow.db")  # and MLflow works in it as in its own
    (default,) = mlflow_client.search_experiments()
    assert default.artifact_location == str(seeded / "mlruns" / "0")
    run = mlflow_client.create_run(mlflow_client.create_experiment("e"))
    mlflow_client.log_metric(run.info.run_id, "loss", 0.5, step=1)
    assert [m.value for m in mlflow_client.get_metric_history(run.info.run_id, "loss")] == [0.5]


def test_a_database_that_exists_is_never_replaced(tmp_path, cache):
    held = tmp_path / "mlflow.db"
    held.write_bytes(b"not mine to replace")
    assert not seed_new_database(f"sqlite:///{held}")
    assert held.read_bytes() == b"not mine to replace"
    assert not seed_new_database(f"sqlite:///{tmp_path}/missing-folder/mlflow.db")
    assert not (tmp_path / "missing-folder").exists()
    assert not seed_new_database("sqlite:///:memory:") and not seed_new_database("postgresql://h/db")


def test_a_deleted_databases_log_beside_it_leaves_the_new_database_to_mlflow(tmp_path, cache):
    """A user who deletes ``mlflow.db`` leaves its ``-wal`` beside it; SQLite would replay that log into a
    copy linked in its place (the old runs back in the new database)."""
    for suffix in ("-wal", "-shm", "-journal"):
        side = tmp_path / f"mlflow.db{suffix}"
        side.write_bytes(b"a deleted database's")
        assert not seed_new_database(f"sqlite:///{tmp_path}/mlflow.db")
        assert not (tmp_path / "mlflow.db").exists() and side.read_bytes() == b"a deleted database's"
        side.unlink()


def test_a_cache_that_cannot_be_written_leaves_the_new_database_to_mlflow(tmp_path, monkeypatch):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))  # its "relaunch" folder cannot be made
    target = tmp_path / "mlflow.db"
    assert not seed_new_database(f"sqlite:///{target}")
    assert not target.exists()
    assert client(f"sqlite:///{target}").search_experiments()[0].experiment_id == "0"  # MLflow made it
