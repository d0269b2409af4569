"""A switch in front of a real ``mlflow server``: an HTTP proxy on 127.0.0.1 that forwards every request,
and, once turned off, answers its API (``/api/...``) with HTTP 500 while ``/health`` still answers 200 —
a tracking server that half-works, as a database that went away behind it leaves one.

    switch = TrackingSwitch(mlflow_server.uri).start()
    switch.off()          # the API answers 500 from now on
    switch.on()           # forwarded again
    switch.stop()
"""

from __future__ import annotations

import http.client
import json
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade"}
NOT_COPIED = HOP_BY_HOP | {"content-length", "server", "date", "host"}  # written anew on each side
BROKEN_ANSWER = json.dumps({"error_code": "INTERNAL_ERROR",
                            "message": "the tracking database is away (the test's switch is off)"}).encode()


class TrackingSwitch:
    """The proxy; ``refused`` counts the API requests answered 500, ``refused_metrics`` those that carried
    training metric points (``runs/log-batch`` with ``train/loss``)."""

    def __init__(self, upstream: str):
        self.upstream = urllib.parse.urlsplit(upstream)
        self.broken = threading.Event()
        self.refused = 0
        self.refused_metrics = 0
        self.forwarded_metrics = 0  # log-batch requests with training points that went through
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None

    @property
    def uri(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> "TrackingSwitch":
        switch = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                switch._handle(self)

            do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = do_GET

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="tracking-switch", daemon=True).start()
        return self

    def off(self) -> None:
        """The API answers 500 from now on; ``/health`` still answers 200."""
        self.broken.set()

    def on(self) -> None:
        """Everything is forwarded again."""
        self.broken.clear()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def _handle(self, request: BaseHTTPRequestHandler) -> None:
        body = _read_body(request)
        carries_metrics = request.path.endswith("/runs/log-batch") and b"train/loss" in body
        if self.broken.is_set() and request.path.startswith("/api/"):
            with self._lock:
                self.refused += 1
                self.refused_metrics += carries_metrics
            _answer(request, 500, {"Content-Type": "application/json"}, BROKEN_ANSWER)
            return
        conn = http.client.HTTPConnection(self.upstream.hostname, self.upstream.port, timeout=120)
        try:
            headers = {k: v for k, v in request.headers.items() if k.lower() not in NOT_COPIED}
            conn.request(request.command, request.path, body=body if body or request.command != "GET" else None,
                         headers=headers)
            response = conn.getresponse()
            data = response.read()
            answer = {k: v for k, v in response.getheaders() if k.lower() not in NOT_COPIED}
        finally:
            conn.close()
        if carries_metrics and response.status == 200:
            with self._lock:
                self.forwarded_metrics += 1
        _answer(request, response.status, answer, data)


def _read_body(request: BaseHTTPRequestHandler) -> bytes:
    if request.headers.get("Transfer-Encoding", "").lower() == "chunked":
        chunks = []
        while True:
            size = int(request.rfile.readline().split(b";")[0].strip() or b"0", 16)
            if not size:
                while request.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                return b"".join(chunks)
            chunks.append(request.rfile.read(size))
            request.rfile.readline()
    length = int(request.headers.get("Content-Length") or 0)
    return request.rfile.read(length) if length else b""


def _answer(request: BaseHTTPRequestHandler, status: int, headers: dict[str, str], body: bytes) -> None:
    request.send_response(status)
    for key, value in headers.items():
        request.send_header(key, value)
    request.send_header("Content-Length", str(len(body)))
    request.send_header("Connection", "close")
    request.end_headers()
    if request.command != "HEAD":
        request.wfile.write(body)
