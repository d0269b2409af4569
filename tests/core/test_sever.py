"""A survivor leaving a broken process group closes its connections, so that a peer blocked in one of
the group's collectives fails at once instead of waiting out the collective timeout (real torchrun,
gloo; the group held alive by a reference, as a survivor's model holds it)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.core.sever_worker import TIMEOUT_SECONDS
from tests.train.conftest import ROOT

pytestmark = pytest.mark.slow


def test_peers_blocked_in_a_collective_of_a_severed_group_fail_at_once_not_at_the_timeout(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3",
                           "-m", "tests.core.sever_worker", "--out", str(tmp_path), "--sever"],
                          cwd=ROOT, capture_output=True, text=True, timeout=4 * TIMEOUT_SECONDS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((tmp_path / "rank0.json").read_text())["closed"] >= 2  # a connection to each peer
    for rank in (1, 2):
        outcome = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert outcome["raised"] and outcome["waited"] < TIMEOUT_SECONDS, outcome
