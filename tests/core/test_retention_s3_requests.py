"""Retention reads no committed manifest twice, counted where it costs: the GET requests the real S3
server (moto, ``tests/moto_s3.py``) answered, read from its own request log (issue 42).

A committed manifest never changes, yet retention had read every kept checkpoint's manifest at every
commit (~30 % of a save's requests on S3). A writer reads a manifest it did not write itself (one an
earlier process committed) at most once; its own, never; and a commit's GETs do not grow with what
is kept.
"""

from __future__ import annotations

import collections
import re
import urllib.parse

from relaunch.components.core.checkpoint import CheckpointManager
from tests.core.helpers import make_state, s3_root, train_steps

# werkzeug's access log line: 127.0.0.1 - - [date] "GET /bucket/key?query HTTP/1.1" 200 -
REQUEST = re.compile(r'"(?P<method>[A-Z]+) (?P<path>/\S*) HTTP/[\d.]+" (?P<status>\d{3})')


class ServerLog:
    """The requests the S3 server logged for one store prefix, read from where the last read stopped."""

    def __init__(self, server, root: str):
        self.path, self.at = server.log, server.log.stat().st_size
        self.prefix = "/" + root.removeprefix("s3://") + "/"

    def since(self) -> list[tuple[str, str]]:
        """(method, key under the prefix) of each request since the last call."""
        with self.path.open("rb") as f:
            f.seek(self.at)
            text = f.read()
        self.at += len(text)
        out = []
        for line in text.decode(errors="replace").splitlines():
            if (m := REQUEST.search(line)) is None:
                continue
            path = urllib.parse.unquote(urllib.parse.urlsplit(m["path"]).path)
            if path.startswith(self.prefix):
                out.append((m["method"], path[len(self.prefix):]))
        return out


def _manifest_gets(requests: list[tuple[str, str]]) -> list[str]:
    return [key for method, key in requests if method == "GET" and key.endswith("/MANIFEST.json")]


def test_each_commit_on_s3_gets_no_committed_manifest_twice_and_no_more_as_checkpoints_are_kept(s3_env):
    root = s3_root(s3_env, "retention-gets")
    state = make_state()
    with CheckpointManager(root, keep_last=3, owner="earlier-writer") as mgr:  # an earlier process's checkpoints
        for step, loss in ((1, 0.5), (2, 0.01), (3, 0.5)):  # 2: the best, kept throughout
            train_steps(state, 1)
            mgr.save(step, state, metrics={"val_loss": loss})
            mgr.wait()
    log = ServerLog(s3_env, root)
    gets_per_commit: list[int] = []
    manifests: collections.Counter[str] = collections.Counter()
    with CheckpointManager(root, keep_last=3, keep_best=1, best_metric="val_loss", owner="this-writer") as mgr:
        log.since()  # opening the manager (its lease, its store check)
        for step in range(4, 11):
            train_steps(state, 1)
            mgr.save(step, state, metrics={"val_loss": 1 / step})
            mgr.wait()
            requests = log.since()
            assert any(m == "PUT" and k.endswith(f"{step:012d}/MANIFEST.json") for m, k in requests), requests
            gets_per_commit.append(sum(1 for method, _ in requests if method == "GET"))
            manifests.update(_manifest_gets(requests))
        assert [i.step for i in mgr.list()] == [2, 8, 9, 10]
    # the earlier process's manifests (1-3), read once each at most; this writer's own (4-10), never
    assert all(n == 1 for n in manifests.values()), manifests
    assert set(manifests) <= {f"checkpoints/step-{s:012d}/MANIFEST.json" for s in (1, 2, 3)}, manifests
    # every commit after the first (which read the earlier manifests) makes the same GETs: what is
    # kept (the last 3 and the best) is not read again
    assert len(set(gets_per_commit[1:])) == 1, gets_per_commit
