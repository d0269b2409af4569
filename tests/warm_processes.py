"""Real torchrun agents and workers for the tests, forked from one warm server per test session (the
``pipelines.local.warm_steps.WarmServer`` that ``relaunch run`` uses): the same torchrun and training code,
without every agent and rank importing torch, DCP and MLflow again (most of a small test's time).

:func:`start` and :func:`run` take the command a test would give ``subprocess``: ``torchrun ...`` or
``python -m module ...`` is forked by the server; anything else, or a machine without warm servers,
runs as a plain subprocess (so does everything with ``RELAUNCH_TEST_COLD=1``). The cold path stays covered by the tests that start processes themselves
(``relaunch run --cold``, the supervisor, the Slurm script, the launcher run by hand)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from components.core.runtime import warm
from pipelines.local.warm_steps import RemoteProcess, WarmServer, supported

ROOT = Path(__file__).resolve().parents[1]
_WORKERS = ("tests.core.fsdp_worker", "tests.core.resume_worker", "components.tasks.digits")
_server: WarmServer | None = None


def _warm_server() -> WarmServer:
    global _server
    if _server is None:
        log = open(tempfile.mkstemp(prefix="relaunch-test-warm-", suffix=".log")[1], "w")  # noqa: SIM115
        _server = WarmServer("full", log, extra_imports=_WORKERS, cwd=str(ROOT))
    return _server


def stop() -> None:
    """End the session's server (conftest calls this when the session finishes)."""
    global _server
    if _server is not None:
        _server.close()
        _server = None


def _target(cmd: list[str]) -> tuple[str, list[str], bool] | None:
    """``(module, argv, is a torchrun agent)`` of a command the server can fork."""
    if Path(cmd[0]).name == "torchrun" and Path(cmd[0]).parent == Path(sys.executable).parent:
        return "torch.distributed.run", list(cmd[1:]), True
    found = warm.module_of(list(cmd))
    if found is None:
        return None
    return found[0], found[1], found[0] == "torch.distributed.run"


def start(cmd: list[str], *, env: dict[str, str], cwd: Path | str, stdout, stderr,
          new_session: bool = False) -> RemoteProcess | subprocess.Popen:
    """Like ``subprocess.Popen(cmd, ...)`` with ``stdout``/``stderr`` open files: forked when it can be."""
    target = _target(cmd) if supported() and not os.environ.get("RELAUNCH_TEST_COLD") else None
    if target is not None:
        proc = _warm_server().start_module(target[0], target[1], env=env, cwd=str(cwd), stdout_fd=stdout.fileno(),
                                           stderr_fd=stderr.fileno(), new_session=new_session, torchrun_agent=target[2])
        if proc is not None:
            return proc
    return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=stdout, stderr=stderr, start_new_session=new_session)


def run(cmd: list[str], *, env: dict[str, str], cwd: Path | str, timeout: float) -> subprocess.CompletedProcess:
    """Like ``subprocess.run(cmd, capture_output=True, text=True, timeout=...)``."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = start(cmd, env=env, cwd=cwd, stdout=out, stderr=err, new_session=True)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(cmd, code, out.read(), err.read())
