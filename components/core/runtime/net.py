"""Small network helpers shared by the launchers and the distributed set-up (no torch import)."""

from __future__ import annotations

import random
import socket

LOWEST_PORT = 20000  # above the worker ports a Ray node takes by default (10002-19999)
EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
_pick = random.Random()  # its own stream: a training or a test seeding the global one must not repeat ports


def _ephemeral_low() -> int:
    """The first port the kernel hands to outgoing connections (Linux; 32768 elsewhere)."""
    try:
        with open(EPHEMERAL_RANGE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now, below the kernel's ephemeral range
    when one is free there: the server it is for binds it later, and in between an outgoing
    connection's local port, taken from that range, cannot take it first (that made a test server
    fail to bind under load)."""
    high = _ephemeral_low() - 1
    for _ in range(64 if high > LOWEST_PORT else 0):
        port = _pick.randint(LOWEST_PORT, high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
