"""A GCS server for the tests: ``gcp-storage-emulator`` (PyPI) in a subprocess on a free port, stopped
by its PID, behind :class:`PreconditionEdge`, a small HTTP proxy that adds what the emulator does not
emulate. Code under test reaches it the way users reach any GCS emulator: ``STORAGE_EMULATOR_HOST``
and nothing else (the official client then sends no credentials).

What gcp-storage-emulator 2026.7.19 does and does not do, as the store uses it:

- ranged reads (``Range: bytes=a-b`` on ``alt=media``), resumable uploads (sessions, 308 with
  ``Range``, status queries), listings with prefix and delimiter, batch-free deletes: emulated;
- generation preconditions (``ifGenerationMatch``): **ignored** (every conditional write lands);
  :class:`PreconditionEdge` evaluates them against the object's current generation and answers
  ``412 conditionNotMet`` as GCS does, serializing writes so that check and write are one step;
- a resumable session that holds nothing yet: the emulator answers a status query with ``308`` and
  ``Range: bytes=0-0`` (one byte held), GCS with no ``Range``; the edge drops that header (the
  writers under test never send a one-byte chunk, so the answer is never true);
- cancelling a resumable session (``DELETE`` on the session URI, GCS answers 499): not routed
  (the emulator answers an error); abandoned sessions stay in its memory until it stops. On GCS an
  abandoned session expires a week after it was opened and its bytes are never billed.
"""

from __future__ import annotations

import http.client
import http.server
import json
import re
import subprocess
import sys
import tempfile
import threading
import urllib.parse
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from components.core.runtime.net import free_port
from tests.services import BIN, http_ok, stop_pid, wait_until

BUCKET = "relaunch-ckpt"


@dataclass
class GcsServer:
    """gcp-storage-emulator (in memory) on 127.0.0.1 behind a :class:`PreconditionEdge`."""

    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None
    edge: "PreconditionEdge | None" = None
    log: Path | None = None

    @property
    def emulator(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def endpoint(self) -> str:
        """What clients talk to: the edge proxy in front of the emulator."""
        return f"http://127.0.0.1:{self.edge.port}"

    def env(self) -> dict[str, str]:
        return {"STORAGE_EMULATOR_HOST": self.endpoint}

    def start(self) -> "GcsServer":
        self.log = Path(tempfile.mkstemp(prefix="gcs-emulator-", suffix=".log")[1])
        self.proc = subprocess.Popen(
            [str(BIN / "gcp-storage-emulator"), "start", "--host", "127.0.0.1", "--port", str(self.port),
             "--in-memory", "--quiet"],
            stdout=self.log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
        wait_until(lambda: http_ok(f"{self.emulator}/"), 30, "gcp-storage-emulator")
        self.edge = PreconditionEdge(self.port).start()
        return self

    def create_bucket(self, name: str = BUCKET) -> None:
        req = urllib.request.Request(f"{self.emulator}/storage/v1/b?project=test", method="POST",
                                     data=json.dumps({"name": name}).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(req, timeout=10).close()
        except urllib.error.HTTPError as err:
            if err.code != 409:  # exists already
                raise

    def root(self, name: str = "ckpt") -> str:
        """A fresh prefix in the test bucket (created on first use)."""
        self.create_bucket()
        return f"gs://{BUCKET}/{name}-{uuid.uuid4().hex[:8]}"

    def stop(self) -> None:
        if self.edge:
            self.edge.stop()
        if self.proc:
            stop_pid(self.proc)


_NAME_IN_JSON = re.compile(rb'"name"\s*:\s*("(?:[^"\\]|\\.)*")')


class PreconditionEdge:
    """An HTTP proxy in front of the emulator that evaluates ``ifGenerationMatch`` on uploads (the
    emulator ignores it): against the generation the emulator reports for the object (0 when absent)
    it forwards the request or answers ``412`` with GCS's ``conditionNotMet`` body. Every write
    (POST, PUT, DELETE) holds one lock, so a precondition check and its write are one step."""

    def __init__(self, upstream_port: int):
        self.upstream_port = upstream_port
        self.lock = threading.Lock()
        self.conditional = 0
        self.refused = 0
        edge = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # headers and body go out in two writes: no 40 ms delayed ACK

            def log_message(self, *args):  # quiet
                pass

            def _any(self):
                edge._forward(self)

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _any

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]

    def start(self) -> "PreconditionEdge":
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def _generation(self, bucket: str, name: str) -> int:
        conn = http.client.HTTPConnection("127.0.0.1", self.upstream_port, timeout=30)
        try:
            conn.request("GET", f"/storage/v1/b/{bucket}/o/{urllib.parse.quote(name, safe='')}")
            resp = conn.getresponse()
            body = resp.read()
            return int(json.loads(body)["generation"]) if resp.status == 200 else 0
        finally:
            conn.close()

    def _forward(self, handler: http.server.BaseHTTPRequestHandler) -> None:
        length = int(handler.headers.get("Content-Length") or 0)
        body = handler.rfile.read(length) if length else b""
        url = urllib.parse.urlsplit(handler.path)
        query = urllib.parse.parse_qs(url.query)
        if handler.command in ("GET", "HEAD"):
            self._relay(handler, body)
            return
        with self.lock:
            wanted = query.get("ifGenerationMatch")
            if wanted and "upload_id" not in query:
                self.conditional += 1
                bucket = url.path.split("/b/", 1)[1].split("/", 1)[0]
                name = query.get("name", [None])[0]
                if name is None and (found := _NAME_IN_JSON.search(body)):
                    name = json.loads(found[1])
                if name is not None and self._generation(bucket, name) != int(wanted[0]):
                    self.refused += 1
                    self._answer(handler, 412, {"error": {"code": 412, "message": "At least one of the pre-"
                                                          "conditions you specified did not hold.", "errors": [
                                                              {"reason": "conditionNotMet"}]}})
                    return
            self._relay(handler, body)

    def _relay(self, handler: http.server.BaseHTTPRequestHandler, body: bytes) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.upstream_port, timeout=120)
        try:
            headers = {k: v for k, v in handler.headers.items() if k.lower() not in ("connection",
                                                                                     "transfer-encoding")}
            conn.request(handler.command, handler.path, body=body or None, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            handler.send_response(resp.status)
            for k, v in resp.getheaders():
                if k.lower() not in ("connection", "transfer-encoding", "content-length", "server", "date"):
                    if resp.status == 308 and k.lower() == "range" and v == "bytes=0-0":
                        continue  # the emulator's "nothing yet" (GCS sends no Range); see the module doc
                    handler.send_header(k, v)
            handler.send_header("Content-Length", str(len(data)))
            handler.end_headers()
            handler.wfile.write(data)
        finally:
            conn.close()

    @staticmethod
    def _answer(handler: http.server.BaseHTTPRequestHandler, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)


@pytest.fixture(scope="session")
def gcs_server():
    """One gcp-storage-emulator (behind its precondition edge) per session."""
    server = GcsServer().start()
    yield server
    server.stop()


@pytest.fixture
def gcs_env(gcs_server, monkeypatch):
    """Point the process at the emulator as users point the official client at one:
    ``STORAGE_EMULATOR_HOST`` only (no credentials in the environment)."""
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    for key, value in gcs_server.env().items():
        monkeypatch.setenv(key, value)
    return gcs_server


if __name__ == "__main__":  # a server for trying things by hand: python -m tests.gcs_server
    server = GcsServer().start()
    server.create_bucket()
    print(f"export STORAGE_EMULATOR_HOST={server.endpoint}", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        server.stop()
        sys.exit(0)
