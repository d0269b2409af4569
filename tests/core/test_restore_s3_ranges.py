"""What a restore from S3 asks the server for, counted on the wire: a proxy in front of the S3 server
(moto over HTTP) logs every request the load sends, so the count is the server's, not our code's."""

from __future__ import annotations

import json
import re
from collections import defaultdict

import torch

import relaunch.components.core.checkpoint.commit as commit
import relaunch.components.core.checkpoint.dcp_io as dcp_io
from relaunch.components.core.checkpoint import CheckpointManager
from relaunch.components.core.trainer.state import TrainingState
from tests.core.faults import ScriptedProxy

CAP = 1 << 20  # the read cap for this test (production: 64 MiB), with production's slack ratio
LAYER = 600  # a 600 x 600 float32 weight and each of its AdamW moments: 1.44 MB, over the cap


class RequestLog(ScriptedProxy):
    """A proxy that forwards every request untouched and keeps its head (request line and headers)."""

    def __init__(self, upstream_port: int):
        super().__init__(upstream_port, rules=[])
        self.heads: list[str] = []

    def _fate_of(self, request: bytes) -> str:
        with self._lock:
            self.heads.append(request.partition(b"\r\n\r\n")[0].decode("latin-1"))
        return "pass"

    def data_gets(self) -> dict[str, list[str]]:
        """{data file name: the Range header of each GET of it}."""
        out: dict[str, list[str]] = defaultdict(list)
        for head in self.heads:
            line, *headers = head.split("\r\n")
            method, path, _ = line.split(" ", 2)
            name = re.search(r"/([^/?]+\.distcp)(\?|$)", path)
            if method == "GET" and name:
                ranges = [h.split(":", 1)[1].strip() for h in headers if h.lower().startswith("range:")]
                out[name.group(1)].append(ranges[0] if ranges else "whole")
        return out


def _training(seed: int, stepped: bool) -> TrainingState:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(LAYER, LAYER), torch.nn.Linear(LAYER, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if stepped:
        model(torch.randn(4, LAYER)).sum().backward()
        optimizer.step()
    return TrainingState(model, optimizer)


def test_a_file_holding_a_tensor_over_the_read_cap_is_fetched_as_one_range_on_the_wire(s3_env, monkeypatch):
    s3_env.create_bucket("one-range")
    root = "s3://one-range/run"
    monkeypatch.setattr(dcp_io, "REQUEST_BYTES", CAP)
    monkeypatch.setattr(dcp_io, "REQUEST_SLACK", CAP // 16)
    monkeypatch.setattr(commit, "FILE_BYTES", 1_600_000)  # the weight and its two moments in a file each
    saved = _training(0, stepped=True)
    with CheckpointManager(root, owner="one-range", async_save=False) as mgr:
        info = mgr.save(1, saved) or mgr.latest()
        manifest = json.loads(mgr.store.read_bytes(f"{info.key}/MANIFEST.json"))
    files = {name: meta for name, meta in manifest["files"].items() if name.endswith(".distcp")}
    over_cap = [name for name, meta in files.items() if meta["size"] > CAP + CAP // 16]
    assert len(over_cap) >= 3, files  # the weight and its moments, each with small items before and after it

    proxy = RequestLog(s3_env.port).start()
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    try:
        restored = _training(1, stepped=False)  # a restarted training: fresh model, no optimizer state
        CheckpointManager(root).load(restored)
    finally:
        proxy.stop()

    for mine, theirs in zip(restored.model.parameters(), saved.model.parameters()):
        assert torch.equal(mine, theirs)
        for key, value in saved.optimizer.state[theirs].items():
            assert torch.equal(restored.optimizer.state[mine][key], value), key
    gets = proxy.data_gets()
    assert set(gets) == set(files), (gets, files)
    for name in over_cap:
        assert gets[name] == [f"bytes=0-{files[name]['size'] - 1}"], (name, gets[name])
