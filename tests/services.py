"""Real services for the tests: an S3 server (moto, over HTTP), PostgreSQL (Debian's binaries, on a
spare port) and an ``mlflow server`` on top of it. Each is a subprocess started here and stopped by
its PID; nothing is left running after the session.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from relaunch.components.core.runtime.net import free_port

BIN = Path(sys.executable).parent
S3_ACCESS_KEY = "relaunch-test-access-key"
S3_SECRET_KEY = "relaunch-test-secret-key-0123456789"


def wait_until(predicate, timeout: float, what: str, interval: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise TimeoutError(f"{what} did not come up within {timeout:.0f}s")


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status < 500
    except Exception:
        return False


def stop_pid(proc: subprocess.Popen, timeout: float = 15) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)


@dataclass
class S3Server:
    """moto's S3 server over HTTP on 127.0.0.1 (``tests/moto_s3.py``); the code under test talks to it as to MinIO."""

    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None
    log: Path | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": S3_ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": S3_SECRET_KEY,
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def start(self) -> "S3Server":
        self.log = Path(tempfile.mkstemp(prefix="moto-", suffix=".log")[1])
        self.proc = subprocess.Popen(
            [sys.executable, "-I", str(Path(__file__).with_name("moto_s3.py")), "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=self.log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
        )
        wait_until(lambda: http_ok(f"{self.endpoint}/moto-api/"), 30, "moto S3 server")
        return self

    def create_bucket(self, name: str) -> None:
        from minio import Minio

        client = Minio(f"127.0.0.1:{self.port}", access_key=S3_ACCESS_KEY, secret_key=S3_SECRET_KEY,
                       secure=False, region="us-east-1")
        if not client.bucket_exists(name):
            client.make_bucket(name)

    def stop(self) -> None:
        if self.proc:
            stop_pid(self.proc)


def _pg_bin(name: str) -> str:
    found = shutil.which(name) or next(iter(sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))), None)
    if not found:
        raise RuntimeError(f"{name} not found: install Debian's postgresql package (.ci/run does)")
    return found


@dataclass
class Postgres:
    """A throwaway PostgreSQL cluster on a spare port, run as the postgres user when we are root.
    ``password``: TCP connections must give it (SCRAM), as a production server asks; None: trusted."""

    port: int = field(default_factory=free_port)
    datadir: Path | None = None
    password: str | None = None

    def _as_owner(self, argv: list[str]) -> list[str]:
        if os.geteuid() == 0:
            return ["runuser", "-u", "postgres", "--", *argv]
        return argv

    def start(self) -> "Postgres":
        self.datadir = Path(tempfile.mkdtemp(prefix="relaunch-pg-"))
        if os.geteuid() == 0:
            shutil.chown(self.datadir, "postgres", "postgres")
        auth = ["--auth=trust"]
        if self.password is not None:
            pwfile = Path(tempfile.mkdtemp(prefix="relaunch-pgpw-")) / "pw"
            pwfile.write_text(self.password + "\n")
            pwfile.parent.chmod(0o755)
            pwfile.chmod(0o644)  # read by initdb as the postgres user; removed right after
            auth = ["--auth-local=trust", "--auth-host=scram-sha-256", f"--pwfile={pwfile}"]
        try:
            subprocess.run(self._as_owner([_pg_bin("initdb"), "-D", str(self.datadir), "-U", "postgres", *auth,
                                           "-E", "UTF8"]),
                           check=True, stdout=subprocess.DEVNULL)
        finally:
            if self.password is not None:
                shutil.rmtree(pwfile.parent, ignore_errors=True)
        opts = f"-p {self.port} -k {self.datadir} -c listen_addresses=127.0.0.1 -c fsync=off"
        subprocess.run(self._as_owner([_pg_bin("pg_ctl"), "-D", str(self.datadir), "-o", opts,
                                       "-l", str(self.datadir / "server.log"), "-w", "start"]),
                       check=True, stdout=subprocess.DEVNULL)
        return self

    def create_database(self, name: str) -> str:
        subprocess.run(self._as_owner([_pg_bin("createdb"), "-h", str(self.datadir), "-p", str(self.port),
                                       "-U", "postgres", name]), check=True)  # the local socket: trusted
        return f"postgresql+psycopg2://postgres@127.0.0.1:{self.port}/{name}"

    @property
    def pid(self) -> int | None:
        pidfile = self.datadir / "postmaster.pid" if self.datadir else None
        return int(pidfile.read_text().split()[0]) if pidfile and pidfile.exists() else None

    def stop(self) -> None:
        pid = self.pid
        if pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGINT)  # PostgreSQL's "fast shutdown"
            with contextlib.suppress(TimeoutError):
                wait_until(lambda: not Path(f"/proc/{pid}").exists(), 20, "postgres shutdown")
        if self.datadir:
            shutil.rmtree(self.datadir, ignore_errors=True)


@dataclass
class MlflowServer:
    """``mlflow server`` with a database backend and proxied artifacts; restartable on the same port."""

    backend_uri: str
    artifacts_dir: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None
    log: Path | None = None

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 90) -> "MlflowServer":
        self.log = self.log or Path(tempfile.mkstemp(prefix="mlflow-server-", suffix=".log")[1])
        self.proc = subprocess.Popen(
            [str(BIN / "mlflow"), "server", "--backend-store-uri", self.backend_uri,
             "--artifacts-destination", str(self.artifacts_dir), "--host", "127.0.0.1",
             "--port", str(self.port), "--workers", "1"],
            stdout=self.log.open("a"), stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
        )
        try:
            wait_until(lambda: http_ok(f"{self.uri}/health"), timeout, "mlflow server", interval=0.5)
        except TimeoutError:
            raise TimeoutError(f"mlflow server did not start; log:\n{self.log.read_text()[-3000:]}") from None
        return self

    def stop(self) -> None:
        if self.proc:
            stop_pid(self.proc)
