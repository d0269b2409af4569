"""The benchmarks: ``python -m tests.bench`` (``make bench``); see __main__.py."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from unittest import mock


@contextlib.contextmanager
def on_emulator(server, env: dict[str, str], prefix: str):
    """A scratch folder for a bench against a started emulator, with ``env`` (how a user points the client at
    it) set in this process; afterwards the environment is as it was, the folder gone, the server stopped."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        with mock.patch.dict(os.environ, env):
            yield work
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
