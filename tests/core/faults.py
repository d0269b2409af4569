"""Fault injection for the checkpoint tests: a Store wrapper that crashes at its k-th operation, and a
TCP proxy that resets connections and answers 503 SlowDown between the S3 client and the S3 server.
Both fake the *outside* (a dying process, a flaky network), never our own code.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import struct
import threading
from collections import Counter
from typing import Any

OPS = ("read_bytes", "write_bytes", "write_if_absent", "upload_file", "download_file", "exists", "etag",
       "list", "delete", "delete_many", "read_into", "open_writer", "sizes")


class InjectedCrash(Exception):
    """The simulated death of the process at a storage operation."""


class FaultyStore:
    """Delegates to ``inner``; operation number ``crash_at`` (1-based) and every later one fail, as
    if the process had died there. ``kill=True`` sends a real SIGKILL to this process instead."""

    def __init__(self, inner: Any, crash_at: int | None = None, kill: bool = False):
        self.inner, self.crash_at, self.kill = inner, crash_at, kill
        self.uri = inner.uri
        self.stats = inner.stats
        self.ops: list[str] = []
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        target = getattr(self.inner, name)
        if name not in OPS:
            return target

        def op(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                self.ops.append(f"{name}({args[0] if args else ''})")
                n = len(self.ops)
            self._maybe_crash(n)
            result = target(*args, **kwargs)
            return _FaultyWriter(self, args[0], result) if name == "open_writer" else result

        return op

    def _maybe_crash(self, n: int) -> None:
        if self.crash_at is not None and n >= self.crash_at:
            if self.kill:
                os.kill(os.getpid(), signal.SIGKILL)
            raise InjectedCrash(f"injected crash at storage op #{n}: {self.ops[-1]}")


class _FaultyWriter:
    """A streamed write whose completion (``close``: the fsync, or the upload's last request) is an
    operation of its own, so a crash can land between a file's first byte and its last."""

    def __init__(self, store: FaultyStore, key: str, inner: Any):
        self.store, self.key, self.inner = store, key, inner

    def write(self, data: Any) -> None:
        self.inner.write(data)

    def abort(self) -> None:
        self.inner.abort()

    def close(self) -> None:
        with self.store._lock:
            self.store.ops.append(f"close_writer({self.key})")
            n = len(self.store.ops)
        self.store._maybe_crash(n)
        self.inner.close()


_SLOWDOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
             b"<Message>Please reduce your request rate.</Message><Resource>/</Resource>"
             b"<RequestId>fault-proxy</RequestId><HostId>fault-proxy</HostId></Error>")


class FaultProxy:
    """A TCP proxy in front of an HTTP server. Every request gets its own connection (the proxy adds
    ``Connection: close`` to responses); per request it draws: reset before forwarding
    (``p_reset``), forward then reset instead of answering (``p_reset_after``: the request landed, the
    answer is lost), answer ``503 SlowDown`` (``p_slowdown``), or pass through."""

    def __init__(self, upstream_port: int, *, p_reset: float = 0.1, p_reset_after: float = 0.03,
                 p_slowdown: float = 0.07, seed: int = 0):
        self.upstream_port = upstream_port
        self.p_reset, self.p_reset_after, self.p_slowdown = p_reset, p_reset_after, p_slowdown
        self.rng = random.Random(seed)
        self.counts: Counter = Counter()
        self._lock = threading.Lock()
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(128)
        self.port = self._sock.getsockname()[1]
        self._stop = False
        self._thread = threading.Thread(target=self._serve, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "FaultProxy":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop = True
        self._sock.close()

    def _serve(self) -> None:
        while not self._stop:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _fate_of(self, request: bytes) -> str:
        """What happens to ``request``: drawn at random here (:class:`ScriptedProxy` chooses)."""
        with self._lock:
            x = self.rng.random()
        if x < self.p_reset:
            return "reset"
        if x < self.p_reset + self.p_reset_after:
            return "reset_after"
        if x < self.p_reset + self.p_reset_after + self.p_slowdown:
            return "slowdown"
        return "pass"

    def _count(self, what: str) -> None:
        with self._lock:
            self.counts[what] += 1

    def _handle(self, conn: socket.socket) -> None:
        self._count("connections")
        try:
            request = _read_request(conn)
            if request is None:
                conn.close()
                return
            self._count("requests")
            fate = self._fate_of(request)
            self._count(fate)
            if fate == "reset":
                _reset(conn)
                return
            if fate in _ANSWERS:
                status, body = _ANSWERS[fate]
                conn.sendall(b"HTTP/1.1 %s\r\nContent-Type: application/xml\r\nContent-Length: %d\r\n"
                             b"Connection: close\r\n\r\n" % (status, len(body)) + body)
                conn.close()
                return
            with socket.create_connection(("127.0.0.1", self.upstream_port), timeout=60) as up:
                up.sendall(request)
                response = _read_all(up)
            if fate == "reset_after":
                _reset(conn)
                return
            head, sep, body = response.partition(b"\r\n")
            conn.sendall(head + b"\r\nConnection: close" + sep + body)
            conn.close()
        except OSError:
            conn.close()


def _reset(conn: socket.socket) -> None:
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    conn.close()


def _read_request(conn: socket.socket) -> bytes | None:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return None
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    lines = head.split(b"\r\n")
    kept = [lines[0]]
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
        if name.strip().lower() == b"connection":
            continue
        kept.append(line)
    kept.append(b"Connection: close")
    while len(body) < length:
        chunk = conn.recv(min(1 << 20, length - len(body)))
        if not chunk:
            return None
        body += chunk
    return b"\r\n".join(kept) + b"\r\n\r\n" + body


def _read_all(sock: socket.socket) -> bytes:
    parts = []
    while chunk := sock.recv(1 << 20):
        parts.append(chunk)
    return b"".join(parts)


class ScriptedProxy(FaultProxy):
    """A :class:`FaultProxy` whose faults are chosen, not drawn. ``rules`` is a list of
    ``(needle, fate, times)``: a request whose head (request line and headers, lower-cased) contains
    ``needle`` gets ``fate`` ("reset", "reset_after" or "slowdown", as in FaultProxy, or "conflict":
    S3's ``409 ConditionalRequestConflict`` to a conditional write that raced another) for its first
    ``times`` matches (None: every time); the first rule that still applies wins; other requests
    pass through. ``counts`` counts the fates dealt."""

    def __init__(self, upstream_port: int, rules: list[tuple[str, str, int | None]]):
        super().__init__(upstream_port, p_reset=0.0, p_reset_after=0.0, p_slowdown=0.0)
        self.rules = [[needle.lower().encode(), fate, times] for needle, fate, times in rules]

    def _fate_of(self, request: bytes) -> str:
        head = request.partition(b"\r\n\r\n")[0].lower()
        with self._lock:
            for rule in self.rules:
                needle, fate, times = rule
                if needle in head and (times is None or times > 0):
                    if times is not None:
                        rule[2] = times - 1
                    return fate
        return "pass"


_CONFLICT = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>ConditionalRequestConflict</Code>'
             b"<Message>A conflicting operation occurred.</Message><Resource>/</Resource>"
             b"<RequestId>fault-proxy</RequestId><HostId>fault-proxy</HostId></Error>")

_ANSWERS = {"slowdown": (b"503 Slow Down", _SLOWDOWN), "conflict": (b"409 Conflict", _CONFLICT)}
"""The fates answered with an S3 error instead of being forwarded."""
