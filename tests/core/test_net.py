"""free_port (components/core/runtime/net.py): a port a server binds later, which neither an outgoing
connection's local port nor a seeded global random stream hands out twice."""

from __future__ import annotations

import random
import socket

from relaunch.components.core.runtime.net import LOWEST_PORT, _ephemeral_low, free_port


def test_a_free_port_is_bindable_and_below_the_ports_outgoing_connections_take():
    port = free_port()
    assert LOWEST_PORT <= port < _ephemeral_low()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_seeding_the_global_random_stream_does_not_repeat_the_ports():
    # two test workers seed random alike (a training's seed): their servers must not get the same ports
    random.seed(0)
    first = [free_port() for _ in range(3)]
    random.seed(0)
    assert [free_port() for _ in range(3)] != first
