"""A store that ignores conditional writes is refused when a training opens it; the stores relaunch
supports pass the probe, once per store per process. The store that ignores them is a real one:
gcp-storage-emulator (tests/gcs_server.py's IgnoringGcsServer)."""

from __future__ import annotations

import pytest

from relaunch.components.core.checkpoint.layout import LEASE
from relaunch.components.core.checkpoint.write_lease import Lease
from relaunch.components.core.contract.errors import BadInput
from relaunch.components.core.store import open_store
from relaunch.components.core.store.conditional_probe import PROBE_PREFIX, require_conditional_writes
from tests.core.helpers import backend_root


@pytest.fixture
def ignoring_store(ignoring_gcs_server, monkeypatch):
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    for key, value in ignoring_gcs_server.env().items():
        monkeypatch.setenv(key, value)
    return open_store(ignoring_gcs_server.root("ignoring"))


@pytest.fixture(params=["fs", "s3", "gcs", "azure"])
def honouring_root(request, tmp_path):
    return backend_root(request, tmp_path, "probe")


def test_a_store_that_ignores_conditional_writes_is_refused_in_one_line_naming_what_to_use(ignoring_store):
    with pytest.raises(BadInput) as err:
        require_conditional_writes(ignoring_store)
    message = str(err.value)
    assert err.value.exit_code == 2 and len(message.splitlines()) == 1
    assert ignoring_store.uri in message and "ignores conditional writes" in message
    assert "fake-gcs-server" in message and "a create-if-absent of an existing key landed" in message
    assert ignoring_store.list(PROBE_PREFIX) == []


def test_a_training_refuses_to_take_its_write_lease_on_a_store_that_ignores_conditional_writes(ignoring_store):
    with pytest.raises(BadInput, match="ignores conditional writes"):
        Lease(ignoring_store, "probe-test", 30).take()
    assert not ignoring_store.exists(LEASE)


def test_every_supported_store_honours_conditional_writes_and_is_probed_once_per_process(honouring_root):
    store = open_store(honouring_root)
    require_conditional_writes(store)
    assert store.list(PROBE_PREFIX) == []
    requests = sum(store.stats.values())
    require_conditional_writes(open_store(honouring_root))
    require_conditional_writes(store)
    assert sum(store.stats.values()) == requests
