"""Azurite, Microsoft's Azure Storage emulator (npm package ``azurite``), for the ``az://`` tests.

Installed on first use with ``npm install --prefix ~/.cache/relaunch/npm azurite@3.37.0`` (or under
``$RELAUNCH_NPM_CACHE``), started as ``azurite-blob`` on a spare port with in-memory persistence and
stopped by its PID. The code under test is pointed at it the way users point the official SDK at an
emulator: ``AZURE_STORAGE_CONNECTION_STRING`` with a ``BlobEndpoint`` and nothing else.

Without npm the tests skip with the reason; with ``CI`` set they fail instead.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from relaunch.components.core.runtime.net import free_port
from tests.services import stop_pid, wait_until

AZURITE_VERSION = "3.37.0"
# Azurite's one built-in account, published in its README (not a secret).
ACCOUNT = "devstoreaccount1"
ACCOUNT_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
CONTAINER = "relaunch-ckpt"


def npm_cache() -> Path:
    return Path(os.environ.get("RELAUNCH_NPM_CACHE") or Path.home() / ".cache" / "relaunch" / "npm")


def azurite_binary() -> Path:
    """The ``azurite-blob`` executable, installed with npm when missing; skip (fail under CI) without npm."""
    binary = npm_cache() / "node_modules" / ".bin" / "azurite-blob"
    if binary.exists():
        return binary
    npm = shutil.which("npm")
    if npm is None or shutil.which("node") is None:
        reason = "npm/node not found: install nodejs and npm to run the Azurite tests"
        if os.environ.get("CI"):
            pytest.fail(f"CI is set but {reason}")
        pytest.skip(reason)
    npm_cache().mkdir(parents=True, exist_ok=True)
    subprocess.run([npm, "install", "--no-audit", "--no-fund", "--prefix", str(npm_cache()),
                    f"azurite@{AZURITE_VERSION}"], check=True, stdout=subprocess.DEVNULL)
    return binary


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


@dataclass
class AzuriteServer:
    """``azurite-blob`` on 127.0.0.1: one account, containers created by the tests."""

    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None
    workdir: Path | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}/{ACCOUNT}"

    def connection_string(self, endpoint: str | None = None) -> str:
        """The connection string the official docs give for Azurite, with this server's port."""
        return (f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={ACCOUNT_KEY};"
                f"BlobEndpoint={endpoint or self.endpoint};")

    def env(self) -> dict[str, str]:
        return {"AZURE_STORAGE_CONNECTION_STRING": self.connection_string()}

    def start(self) -> "AzuriteServer":
        binary = azurite_binary()
        self.workdir = Path(tempfile.mkdtemp(prefix="azurite-"))
        log = (self.workdir / "azurite.log").open("w")
        self.proc = subprocess.Popen(
            [str(binary), "--blobHost", "127.0.0.1", "--blobPort", str(self.port), "--inMemoryPersistence",
             "--skipApiVersionCheck", "--loose", "--silent", "--disableTelemetry"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        wait_until(lambda: self.proc.poll() is not None or _listening(self.port), 60, "azurite-blob")
        if self.proc.poll() is not None:
            raise RuntimeError(f"azurite-blob exited: {(self.workdir / 'azurite.log').read_text()[-2000:]}")
        return self

    def client(self):
        from azure.storage.blob import BlobServiceClient

        return BlobServiceClient.from_connection_string(self.connection_string())

    def create_container(self, name: str = CONTAINER) -> str:
        from azure.core.exceptions import ResourceExistsError

        try:
            self.client().create_container(name)
        except ResourceExistsError:
            pass
        return name

    def root(self, name: str = "ckpt") -> str:
        """A fresh ``az://`` prefix in the test container (created on first use)."""
        return f"az://{self.create_container()}/{name}-{uuid.uuid4().hex[:8]}"

    def stop(self) -> None:
        if self.proc:
            stop_pid(self.proc)
        if self.workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
