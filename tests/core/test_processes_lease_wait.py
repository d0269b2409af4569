"""A writer that waits for the write lease of a live holder of the same training (a ``--resume`` while
the writer on another host has not let go) says what it waits for and for how long at most: one line at
once, another every few seconds, on stderr and as a ``waiting`` event for ``relaunch run``'s console."""

from __future__ import annotations

import json
import time

from relaunch.components.core.checkpoint.layout import LEASE
from relaunch.components.core.checkpoint.write_lease import WAIT_LINE_SECONDS, Lease
from relaunch.components.core.contract import events
from relaunch.components.core.contract.events import Kind
from relaunch.components.core.store import open_store


def test_waiting_for_a_live_holders_lease_says_who_holds_it_and_how_long_at_most_then_takes_it(
        tmp_path, capsys, monkeypatch):
    path = tmp_path / "events.jsonl"
    monkeypatch.setenv(events.EVENTS_ENV, str(path))
    store = open_store(str(tmp_path / "store"))
    holds_for = WAIT_LINE_SECONDS + 1.5  # long enough for a second line
    store.write_bytes(LEASE, json.dumps({"owner": "run:r1", "token": "theirs", "host": "another-host", "pid": 4242,
                                         "pid_namespace": "0", "expires_at": time.time() + holds_for}).encode())
    lease = Lease(store, "run:r1", seconds=2, wait_seconds=60)
    lease.take()  # returns once the holder's lease expired unrenewed
    assert lease.held
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("relaunch: ")]
    assert len(lines) >= 2, lines
    assert lines[0].startswith("relaunch: waiting for the write lease: ") and "still waiting" in lines[1], lines
    for line in lines:
        assert "'run:r1' (host another-host, pid 4242)" in line and "waiting at most" in line, line
    shown = [e["line"] for e in events.read_file(path)[0] if e.kind == Kind.WAITING]
    assert [f"relaunch: {line}" for line in shown] == lines
