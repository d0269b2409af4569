"""``relaunch run --set store.uri=az://...`` end to end against Azurite, with nothing but
``AZURE_STORAGE_CONNECTION_STRING`` (a ``BlobEndpoint`` in it) set, as a user points the SDK at an
emulator; and a missing container refused in one line, exit 2, before anything is written."""

from __future__ import annotations

import json
import subprocess
import uuid
from pathlib import Path

import pytest

from relaunch.components.core.store import open_store
from tests.cli import relaunch_run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _run(cwd: Path, azurite, *args: str) -> subprocess.CompletedProcess:
    return relaunch_run(cwd, "--set", "train.max_steps=20", *args, env=azurite.env(),
                        without=("AWS_", "MINIO_", "AZURE_"), timeout=540)


def test_relaunch_run_trains_and_commits_checkpoints_on_azurite_with_only_a_connection_string(tmp_path, azure_env):
    root = azure_env.root("e2e")
    out = _run(tmp_path, azure_env, "--set", f"store.uri={root}")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    store = open_store(root)
    pointers = [k for k in store.list() if k.endswith("checkpoints/latest.json")]
    assert len(pointers) == 1, store.list()
    latest = json.loads(store.read_bytes(pointers[0]))
    assert "step-000000000020" in json.dumps(latest)


def test_relaunch_run_refuses_a_missing_container_in_one_line_with_exit_2(tmp_path, azure_env):
    out = _run(tmp_path, azure_env, "--set", f"store.uri=az://no-such-{uuid.uuid4().hex[:6]}/x")
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert len(lines) == 1 and "does not exist" in lines[0], lines
