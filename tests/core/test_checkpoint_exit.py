"""Exit is safe: a save still running in the background when the program returns from main commits
before the process ends (or the process says in one line that it did not, with a non-zero exit),
and no lease is left behind."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from relaunch.components.core.checkpoint import LEASE, CheckpointManager
from relaunch.components.core.checkpoint.readers import READERS
from relaunch.components.core.contract.exitcodes import ExitCode
from relaunch.components.core.store import open_store
from tests.core.helpers import s3_root

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(params=["fs", "s3"])
def root(request, tmp_path):
    if request.param == "fs":
        return str(tmp_path / "store")
    return s3_root(request.getfixturevalue("s3_env"), "exit")


def _program(root: str, link: str) -> str:
    """Save step 1 in the background through a store link ``link``, then return from main."""
    return textwrap.dedent(f"""
        import time
        from relaunch.components.core.checkpoint import CheckpointManager
        from relaunch.components.core.contract.errors import TransientFailure
        from relaunch.components.core.store import open_store
        from tests.core.helpers import make_state

        class SlowLink:  # the external store, slow to take a manifest (a big upload finishing)
            def __init__(self, inner, fail):
                self.inner, self.fail = inner, fail
            def __getattr__(self, name):
                attr = getattr(self.inner, name)
                def call(*args, **kwargs):
                    if name == "write_bytes" and str(args[0]).endswith("/MANIFEST.json"):
                        time.sleep(1.0)
                        if self.fail:
                            raise TransientFailure("the store went away while committing")
                    return attr(*args, **kwargs)
                return call if callable(attr) else attr

        def main():
            mgr = CheckpointManager(SlowLink(open_store({root!r}), fail={link == "failing"!r}), keep_last=3)
            mgr.save(1, make_state())
            print("saved in the background", flush=True)

        main()
    """)


def _run(root: str, link: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _program(root, link)], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=180)


def test_a_save_pending_when_main_returns_is_committed_and_no_lease_is_left(root):
    result = _run(root, "slow")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "saved in the background" in result.stdout
    store = open_store(root)
    assert not store.exists(LEASE)
    with CheckpointManager(store) as reader:
        assert reader.verify(1).step == 1
    assert store.list(READERS + "/") == []


def test_a_pending_save_that_fails_at_exit_ends_the_process_non_zero_with_one_line(root):
    result = _run(root, "failing")
    lines = [line for line in result.stderr.splitlines() if line.startswith("relaunch:")]
    assert result.returncode == ExitCode.RETRY_ME, result.stderr[-3000:]
    assert len(lines) == 1 and "did not complete" in lines[0] and "went away" in lines[0], result.stderr[-3000:]
    store = open_store(root)
    assert not store.exists("checkpoints/step-000000000001/MANIFEST.json")
    assert not store.exists(LEASE)  # the next attempt need not wait for a lease of a process that is gone
    assert store.list(READERS + "/") == []
