"""The memory tier's transport: a packed snapshot (:mod:`.packing`) handed to a peer's replica server over
plain TCP, listed and fetched back from it. It does not depend on the process group, which is broken exactly
when a replica is needed.

    server = ReplicaServer(host)                       # this rank's listener, on a daemon thread
    put_replica(address, owner, header, payload)       # a rank's snapshot to its holder
    list_replicas(address, owner)                      # the (step, fingerprint) the holder keeps
    get_replica(address, owner, step)                  # a replacement fetches its own back
"""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import sys
import threading

import numpy as np

from .packing import new_payload

_HEAD = struct.Struct("!cIq")  # op ('P' put, 'G' get, 'L' list), owner rank, step ('G': -1 the newest)
_LEN = struct.Struct("!Q")
SOCKET_TIMEOUT_SECONDS = 30.0
KEPT = 2  # snapshots of each kind a rank holds (its own, its peer's replicas): the newest and the one before



def _recv_exact(sock: socket.socket, n: int, into: memoryview | None = None) -> memoryview:
    buf = into if into is not None else memoryview(bytearray(n))
    got = 0
    while got < n:
        k = sock.recv_into(buf[got:], n - got)
        if not k:
            raise ConnectionError("memory tier: the peer closed the connection mid-transfer")
        got += k
    return buf


def _send_blob(sock: socket.socket, header: dict, payload: np.ndarray) -> None:
    raw = json.dumps(header).encode()
    sock.sendall(_LEN.pack(len(raw)) + raw)
    sock.sendall(memoryview(payload))


def _recv_blob(sock: socket.socket, reuse: np.ndarray | None = None) -> tuple[dict, np.ndarray]:
    raw = bytes(_recv_exact(sock, _LEN.unpack(bytes(_recv_exact(sock, _LEN.size)))[0]))
    header = json.loads(raw)
    size = int(header["bytes"])
    payload = reuse if reuse is not None and len(reuse) == size else new_payload(size)
    if size:
        _recv_exact(sock, size, memoryview(payload))
    return header, payload


class ReplicaServer:
    """This rank's listener: holds the ``KEPT`` newest replicas a peer puts, and hands one back to
    whoever asks (the peer's replacement). A put is received into the memory of the oldest, never of
    the newest: a peer lost in the middle of its put leaves the replica before it whole. One
    connection at a time, on a daemon thread."""

    def __init__(self, host: str = "127.0.0.1"):
        self.sock = socket.create_server((host, 0))
        self.address = f"{host}:{self.sock.getsockname()[1]}"
        self.replicas: list[tuple[dict, np.ndarray]] = []  # (header with the owner's tag, payload), newest first
        self.lock = threading.Lock()
        threading.Thread(target=self._serve, name="memory-tier-replica", daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                try:
                    conn.settimeout(SOCKET_TIMEOUT_SECONDS)
                    self._answer(conn)
                except (OSError, ValueError, ConnectionError) as err:
                    print(f"relaunch: memory tier: a replica transfer failed: {err}", file=sys.stderr, flush=True)

    @property
    def replica(self) -> tuple[dict, np.ndarray] | None:
        """The newest replica held."""
        with self.lock:
            return self.replicas[0] if self.replicas else None

    def _held(self, owner: int) -> list[tuple[dict, np.ndarray]]:
        with self.lock:
            return [held for held in self.replicas if held[0].get("owner") == owner]

    def _answer(self, conn: socket.socket) -> None:
        op, owner, step = _HEAD.unpack(bytes(_recv_exact(conn, _HEAD.size)))
        if op == b"P":
            with self.lock:  # received into the oldest replica's memory when it fits, the newest kept whole
                if self.replicas and self.replicas[0][0].get("owner") != owner:
                    self.replicas = []  # the ring changed: another peer's now
                spare = self.replicas.pop() if len(self.replicas) >= KEPT else None
            header, payload = _recv_blob(conn, spare[1] if spare is not None else None)
            header["owner"] = owner
            with self.lock:
                self.replicas.insert(0, (header, payload))
            conn.sendall(b"k")
        elif op == b"L":
            raw = json.dumps([[h["step"], h.get("fingerprint")] for h, _ in self._held(owner)]).encode()
            conn.sendall(_LEN.pack(len(raw)) + raw)
        elif op == b"G":
            held = [h for h in self._held(owner) if step < 0 or h[0]["step"] == step][:1]
            if not held:
                conn.sendall(_LEN.pack(0))
                return
            _send_blob(conn, held[0][0], held[0][1])

    def close(self) -> None:
        with contextlib.suppress(OSError):  # wakes the accept() of the server thread, which then ends
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


def _connect(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=SOCKET_TIMEOUT_SECONDS)


def put_replica(address: str, owner: int, header: dict, payload: np.ndarray) -> None:
    """Hand ``owner``'s packed snapshot to the replica server at ``address``."""
    with _connect(address) as sock:
        sock.sendall(_HEAD.pack(b"P", owner, -1))
        _send_blob(sock, header, payload)
        if _recv_exact(sock, 1).tobytes() != b"k":
            raise ConnectionError("memory tier: the holder did not take the replica")


def list_replicas(address: str, owner: int) -> list[tuple[int, str | None]]:
    """The (step, fingerprint) of each of ``owner``'s replicas the server at ``address`` holds, newest first."""
    with _connect(address) as sock:
        sock.sendall(_HEAD.pack(b"L", owner, -1))
        size = _LEN.unpack(bytes(_recv_exact(sock, _LEN.size)))[0]
        return [(int(step), fp) for step, fp in json.loads(bytes(_recv_exact(sock, size)))]


def get_replica(address: str, owner: int, step: int = -1) -> tuple[dict, np.ndarray] | None:
    """``owner``'s replica of ``step`` (-1: the newest) from the server at ``address``, or None when it
    holds none such."""
    with _connect(address) as sock:
        sock.sendall(_HEAD.pack(b"G", owner, step))
        size = _LEN.unpack(bytes(_recv_exact(sock, _LEN.size)))[0]
        if size == 0:
            return None
        header = json.loads(bytes(_recv_exact(sock, size)))
        payload = new_payload(int(header["bytes"]))
        if len(payload):
            _recv_exact(sock, len(payload), memoryview(payload))
        return header, payload
