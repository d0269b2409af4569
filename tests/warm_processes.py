"""Real torchrun agents and workers for the tests, started warm the way a node starts them: through one
zygote per test session (:mod:`relaunch.components.core.runtime.zygote`, the mechanism ``relaunch run`` and a pod use),
so that agents and ranks do not each import torch and DCP again (most of a small test's time).

:func:`start` and :func:`run` take the command a test would give ``subprocess``. ``torchrun ...`` and
``python -m module ...`` become the zygote client's command (torchrun's workers too, with
``--no-python``); the process started is always a plain ``subprocess.Popen`` of that client, which
ends as its forked process does. Anything else, a machine without the zygote's pidfds, or
``RELAUNCH_TEST_COLD=1`` (the CI's cold lane, .ci/run) runs the command as given: fresh interpreters
all the way down, as on a cluster with the warm runtime off.

:func:`shared_steps_env` gives the ``relaunch run`` of a test (tests/cli.py) the session's shared warm step
servers (:func:`relaunch.pipelines.local.warm_steps.start_shared`): one light and one full server per
session (per xdist worker), started at the first run, so that each run forks its steps instead of
starting two servers that import kfp, MLflow and torch again (~17 s of CPU a run)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from relaunch.components.core.runtime.zygote import Zygote, client_command

ROOT = Path(__file__).resolve().parents[1]
COLD_ENV = "RELAUNCH_TEST_COLD"
_WORKERS = ("tests.core.fsdp_worker", "tests.core.resume_worker", "relaunch.components.tasks.digits", "tests.core.warm_child")
_zygote: Zygote | None = None
_dir: tempfile.TemporaryDirectory | None = None
_steps_dir: tempfile.TemporaryDirectory | None = None
_steps_servers: list = []
_SESSION_ENV = dict(os.environ)  # the session's, before any test changes its own (HOME, MLFLOW_*, a folder)


def cold() -> bool:
    """True when the tests start every process as a fresh interpreter."""
    return bool(os.environ.get(COLD_ENV)) or sys.platform != "linux" or not hasattr(os, "pidfd_open")


def _session_zygote() -> Zygote:
    global _zygote, _dir
    if _zygote is None:
        _dir = tempfile.TemporaryDirectory(prefix="relaunch-test-zygote-")
        log = open(Path(_dir.name, "zygote.log"), "w")  # noqa: SIM115 - lives as long as the zygote
        _zygote = Zygote(str(Path(_dir.name, "socket")), _WORKERS, log=log,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=str(ROOT))
    return _zygote


def shared_steps_env() -> dict[str, str]:
    """``{RELAUNCH_WARM_SERVERS: <folder>}`` of the session's shared warm step servers (started now if
    they are not running); ``{}`` when the tests run cold."""
    global _steps_dir, _steps_servers
    from relaunch.pipelines.local.warm_steps import SHARED_ENV, start_shared, supported

    if cold() or not supported():
        return {}
    if not _steps_servers or any(server.process.poll() is not None for server in _steps_servers):
        for server in _steps_servers:
            server.close()
        if _steps_dir is None:
            _steps_dir = tempfile.TemporaryDirectory(prefix="relaunch-test-steps-")
        log = open(Path(_steps_dir.name, "servers.log"), "a")  # noqa: SIM115 - lives as long as the servers
        _steps_servers = start_shared(_steps_dir.name, log, cwd=str(ROOT), env=_SESSION_ENV)
    return {SHARED_ENV: _steps_dir.name}


def stop() -> None:
    """End the session's zygote and shared step servers (conftest calls this when the session finishes)."""
    global _zygote, _dir, _steps_dir, _steps_servers
    for server in _steps_servers:
        server.close()
    _steps_servers = []
    if _steps_dir is not None:
        _steps_dir.cleanup()
        _steps_dir = None
    if _zygote is not None:
        _zygote.close()
        _zygote = None
    if _dir is not None:
        _dir.cleanup()
        _dir = None


def warm_command(cmd: list[str]) -> list[str] | None:
    """The zygote client's form of ``cmd`` (``torchrun ...`` or ``python -m module ...``), else None."""
    client = client_command()
    if Path(cmd[0]).name == "torchrun" and Path(cmd[0]).parent == Path(sys.executable).parent:
        args = list(cmd[1:])
    elif cmd[:3] == [sys.executable, "-m", "torch.distributed.run"] or cmd[:4] == [sys.executable, "-u", "-m", "torch.distributed.run"]:
        args = cmd[cmd.index("torch.distributed.run") + 1:]
    elif len(cmd) >= 3 and cmd[0] == sys.executable and (cmd[1:3][0] == "-m" or cmd[1:3] == ["-u", "-m"]):
        rest = cmd[1:] if cmd[1] == "-m" else cmd[2:]
        return [*client, *rest]
    else:
        return None
    # torchrun's options come first (some with their value as the next word: --nproc-per-node 2); its
    # training entry (-m MODULE) then runs through the client too
    entry = args.index("-m") if "-m" in args else None
    if entry is None or "--no-python" in args[:entry]:
        return [*client, "-m", "torch.distributed.run", *args]
    return [*client, "-m", "torch.distributed.run", *args[:entry], "--no-python", *client, *args[entry:]]


def popen(cmd: list[str], *, env: dict[str, str], **kwargs) -> subprocess.Popen:
    """``subprocess.Popen(cmd, env=env, **kwargs)``: warm when it can be (the fork gets the client's
    descriptors, pipes included)."""
    warm = None if cold() else warm_command(list(cmd))
    if warm is not None:
        cmd, env = warm, {**env, **_session_zygote().env}
    return subprocess.Popen(cmd, env=env, **kwargs)


def start(cmd: list[str], *, env: dict[str, str], cwd: Path | str, stdout, stderr,
          new_session: bool = False) -> subprocess.Popen:
    """Like ``subprocess.Popen(cmd, ...)`` with ``stdout``/``stderr`` open files: warm when it can be."""
    return popen(cmd, env=env, cwd=cwd, stdout=stdout, stderr=stderr, start_new_session=new_session)


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
