"""A study's PostgreSQL password comes from the environment (``PGPASSWORD``, which libpq reads: on a
cluster from the Secret ``launch.kubernetes.study_secret``), never from ``tune.storage``; with a real
PostgreSQL that asks for it (SCRAM over TCP, as a production server does)."""

from __future__ import annotations

import secrets

import optuna
import pytest

from relaunch.components.core.contract.errors import BadInput
from relaunch.components.core.tuning.study import open_storage
from tests.services import Postgres


@pytest.fixture(scope="module")
def guarded_postgres():
    pg = Postgres(password=secrets.token_hex(12)).start()
    yield pg
    pg.stop()


def test_the_study_storage_opens_with_the_password_from_pgpassword_and_refuses_without_it(guarded_postgres,
                                                                                          monkeypatch):
    url = guarded_postgres.create_database("optuna_guarded")
    assert "@" in url and ":" not in url.split("://", 1)[1].split("@", 1)[0]  # no password in the URL

    monkeypatch.delenv("PGPASSWORD", raising=False)
    with pytest.raises(BadInput) as missing:
        open_storage(url)
    assert str(missing.value).startswith("tune.storage: cannot open the Optuna storage")

    wrong = secrets.token_hex(12)
    monkeypatch.setenv("PGPASSWORD", wrong)
    with pytest.raises(BadInput) as refused:
        open_storage(url)
    assert "password authentication failed" in str(refused.value) and wrong not in str(refused.value)
    assert "\n" not in str(refused.value)

    monkeypatch.setenv("PGPASSWORD", guarded_postgres.password)
    storage = open_storage(url)
    study = optuna.create_study(storage=storage, study_name="guarded")
    study.tell(study.ask(), 1.0)
    assert len(optuna.load_study(study_name="guarded", storage=open_storage(url)).trials) == 1
