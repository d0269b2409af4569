"""The shared warm step servers (pipelines/local/warm_steps.py, :func:`start_shared`): the test suite's
``relaunch run`` forks its steps from one light and one full server per session instead of starting two per
run. Each run is its own connection; its steps get the run's environment, working directory (first on
``sys.path``, as ``python -m`` puts it) and temporary folder, not the server's; a run whose PYTHONPATH is
not the servers' starts its own; the servers outlive their runs."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from relaunch.pipelines.local.warm_steps import SHARED_ENV, shared_servers, start_shared, supported

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not supported(), reason="warm servers need Linux pidfds")


@pytest.fixture
def shared(tmp_path, monkeypatch):
    """Shared servers importing nothing but the probe (which caches the server's temporary folder),
    started in the repository with TMPDIR at ``server-tmp``."""
    folder = tmp_path / "servers"
    folder.mkdir()
    (tmp_path / "server-tmp").mkdir()
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("TMPDIR", str(tmp_path / "server-tmp"))
    with open(tmp_path / "servers.log", "w") as log:
        servers = start_shared(str(folder), log, imports="none", extra_imports=("tests.pipelines.warm_probe",))
    yield folder
    for server in servers:
        server.close()
    assert [server.process.returncode for server in servers] == [0, 0]


def _probe(folder: Path, run: Path, probe: str) -> dict:
    """One step of a run in ``run`` (its own connection, then closed), as WarmSteps starts it."""
    env = {**os.environ, SHARED_ENV: str(folder), "WARM_PROBE": probe, "TMPDIR": str(run / "tmp")}
    connected = shared_servers(env)
    assert connected is not None
    servers, zygote_socket = connected
    assert zygote_socket == str(folder / "zygote.sock")
    read_end, write_end = os.pipe()
    step = servers["light"].start({"kind": "module", "module": "tests.pipelines.warm_probe", "argv": [],
                                   "env": env, "cwd": str(run)}, [write_end, write_end])
    os.close(write_end)
    assert step is not None, "the shared server refused"
    with os.fdopen(read_end) as output:
        text = output.read()
    assert step.wait(60) == 0, text
    for server in servers.values():
        server.close()
    return json.loads(next(line for line in text.splitlines() if line.startswith("{")))


def test_each_run_of_a_shared_server_gets_its_own_environment_folder_path_and_temporary_folder(shared, tmp_path):
    runs = []
    for name in ("first", "second"):
        run = tmp_path / name
        (run / "tmp").mkdir(parents=True)
        runs.append(run)
    (runs[0] / "only_in_the_runs_folder.py").write_text("")
    first, second = _probe(shared, runs[0], "one"), _probe(shared, runs[1], "two")
    assert (first["probe"], first["cwd"], first["path0"], first["temp"]) == ("one", str(runs[0]), str(runs[0]),
                                                                               str(runs[0] / "tmp"))
    assert (second["probe"], second["cwd"], second["path0"], second["temp"]) == ("two", str(runs[1]), str(runs[1]),
                                                                                  str(runs[1] / "tmp"))
    assert first["local"] and not second["local"]  # a module of the run's folder imports, as cold
    assert first["ppid"] == second["ppid"]  # both forks of the one server, which outlived the first run


def test_a_run_whose_pythonpath_is_not_the_shared_servers_starts_its_own(shared):
    env = {**os.environ, SHARED_ENV: str(shared)}
    assert shared_servers({**env, "PYTHONPATH": f"{env.get('PYTHONPATH', '')}{os.pathsep}/elsewhere"}) is None
    assert shared_servers({**env, SHARED_ENV: str(shared / "gone")}) is None
    connected = shared_servers(env)
    assert connected is not None
    for server in connected[0].values():
        server.close()


def test_the_suites_relaunch_run_uses_the_sessions_shared_servers_unless_told_otherwise(monkeypatch):
    from tests import cli, warm_processes

    given = []
    monkeypatch.setattr(warm_processes, "shared_steps_env", lambda: {SHARED_ENV: "/the/session/servers"})
    monkeypatch.setattr(cli, "relaunch", lambda cwd, *args, env=None, **kwargs: given.append(env or {}))
    monkeypatch.delenv(cli.SHARED_OFF_ENV, raising=False)
    cli.relaunch_run(ROOT, env={"HOME": "/h"})
    cli.relaunch_run(ROOT, "--cold")  # every process a fresh interpreter: no server at all
    cli.relaunch_run(ROOT, shared=False)  # a run interrupted or killed from outside: its steps must be its own
    monkeypatch.setenv(cli.SHARED_OFF_ENV, "1")
    cli.relaunch_run(ROOT)
    assert given == [{SHARED_ENV: "/the/session/servers", "HOME": "/h"}, {}, {}, {}]


def test_the_steps_of_a_run_that_left_a_shared_server_are_killed_after_the_stop_grace(shared, tmp_path):
    """A run killed outright (its guardian cannot see a shared server's forks: their environment is the
    server's) closes its connection: its steps get the stop grace, then die; the server goes on."""
    import time

    from relaunch.pipelines.local.warm_steps import STOP_GRACE_SECONDS

    servers, _ = shared_servers({**os.environ, SHARED_ENV: str(shared)})
    read_end, write_end = os.pipe()
    step = servers["light"].start({"kind": "module", "module": "tests.core.warm_child", "argv": ["sleep", "600"],
                                   "env": dict(os.environ), "cwd": str(ROOT)}, [write_end, write_end])
    os.close(write_end)
    with os.fdopen(read_end) as output:
        child = json.loads(output.readline())
        assert output.readline().strip() == "ready"
        left = time.monotonic()
        for server in servers.values():
            server.close()  # the run is gone
        deadline = left + STOP_GRACE_SECONDS + 60
        while Path(f"/proc/{child['pid']}").exists() and Path(f"/proc/{child['pid']}/stat").read_text().split()[2] != "Z" \
                and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not Path(f"/proc/{child['pid']}").exists(), "the departed run's step still runs"
        assert output.read() == ""  # its output ended with it
    assert step.pid == child["pid"]
    assert _probe(shared, tmp_path, "after")["probe"] == "after"  # the server took the next run
