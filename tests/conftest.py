"""Session-wide real services and the shared-schema locator; see tests/services.py."""

from __future__ import annotations

import os
import signal
import tempfile
from pathlib import Path

import pytest

from relaunch.components.core.runtime.wiring import wire
from tests.services import MlflowServer, Postgres, S3Server

ROOT = Path(__file__).resolve().parents[1]
SCHEMAS = ROOT.parent / "shared" / "schemas"


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_configure(config):
    wire()  # the tests' process is an entry point: its configurations validate against the full tables
    # A session stopped by SIGTERM (CI's or timeout's) tears its servers down like a Ctrl-C does,
    # instead of leaving PostgreSQL, moto and mlflow running.
    signal.signal(signal.SIGTERM, _interrupt)


def pytest_collection_modifyitems(config, items):
    """Files with slow tests first, each file's tests in their order: pytest-xdist (``--dist loadfile``)
    hands out whole files in this order, so the long files start early and short ones fill the end,
    instead of the alphabet's last folders (train, tune: long trainings and studies) running alone."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)


def pytest_sessionfinish(session, exitstatus):
    from tests import warm_processes

    warm_processes.stop()


@pytest.fixture(autouse=True)
def mlflow_environment_restored():
    """MLflow's variables as they were before each test: ``mlflow.set_tracking_uri`` in a test's process
    exports ``MLFLOW_TRACKING_URI``, which relaunch prefers to ``tracking.uri``, so a later test of the same
    xdist worker would track into that test's database (test_study_stops found no trial run in its own)."""
    before = {k: v for k, v in os.environ.items() if k.startswith("MLFLOW_")}
    yield
    for key in [k for k in os.environ if k.startswith("MLFLOW_") and k not in before]:
        del os.environ[key]
    os.environ.update(before)


@pytest.fixture(scope="session")
def schemas_dir() -> Path:
    """``../shared/schemas``: skipped with a reason when absent, a failure when CI is set."""
    if not SCHEMAS.is_dir():
        if os.environ.get("CI"):
            pytest.fail(f"CI is set but the upstream schemas are missing at {SCHEMAS}")
        pytest.skip(f"upstream schemas not found at {SCHEMAS} (../shared beside the project)")
    return SCHEMAS


@pytest.fixture(scope="session")
def s3_server():
    server = S3Server().start()
    yield server
    server.stop()


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    """Point the process environment at the test S3 server (credentials as a Secret would)."""
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    return s3_server


@pytest.fixture(scope="session")
def postgres():
    pg = Postgres().start()
    yield pg
    pg.stop()


@pytest.fixture(scope="session")
def mlflow_server(postgres):
    """One real ``mlflow server`` per session (it takes 20-30 s to start), Postgres backend."""
    backend = postgres.create_database("mlflow")
    server = MlflowServer(backend_uri=backend, artifacts_dir=Path(tempfile.mkdtemp(prefix="mlflow-art-"))).start()
    yield server
    server.stop()


from tests.gcs_server import gcs_env, gcs_server, ignoring_gcs_server  # noqa: E402,F401 - the GCS servers
@pytest.fixture(scope="session")
def azurite():
    """One Azurite blob server per session (tests/azure_server.py; skipped without npm unless CI)."""
    from tests.azure_server import AzuriteServer

    server = AzuriteServer().start()
    yield server
    server.stop()


@pytest.fixture
def azure_env(azurite, monkeypatch):
    """Only AZURE_STORAGE_CONNECTION_STRING (with a BlobEndpoint), as a user points the SDK at an emulator."""
    for key, value in azurite.env().items():
        monkeypatch.setenv(key, value)
    return azurite
