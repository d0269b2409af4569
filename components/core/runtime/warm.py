"""Warm processes: start a Python module as a fork of a process that already imported what it needs.

A local ``relaunch run`` is mostly interpreter start-up: every step, every torchrun agent and every
worker is a fresh Python that imports kfp, MLflow (and its SQL store) and torch again, seconds each
on a small machine. :mod:`pipelines.local.warm_steps` imports them once in server processes and forks every
kfp.local step from one of them; a step forked that way is *warm* (:data:`forked` is true), and the
processes it starts are forks of itself too:

- the local launcher starts each torchrun agent with :func:`start_python` (a fork when warm, else
  ``subprocess.Popen``), and
- a warm agent starts its workers with :func:`fork_workers` installed (torch elastic's
  ``SubprocessHandler`` forks ``python -u -m <module>`` instead of executing it).

Each fork is a real child of the process that asked for it: same pid semantics (``os.getpid`` in a
worker is the pid its agent signals), new session when asked, its own stdout/stderr, environment and
``sys.argv``, default signal handlers, the ``atexit`` handlers of its own and of its imports (not its
parent's), and the exit status Python
itself would give (``SystemExit`` code, 1 for an uncaught exception, death by SIGINT for Ctrl-C).
:class:`ForkedProcess` is the ``Popen`` part the launcher and torch elastic use. On a cluster nothing
here runs: each pod is a fresh ``torchrun``.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import os
import runpy
import signal
import subprocess
import sys
import time
import traceback
import warnings
import weakref
from typing import Callable

forked = False
"""True in a process forked from a warm server (and in the processes it forks in turn)."""
_import_time_exit_handlers: list[tuple[Callable, tuple, dict]] = []


@contextlib.contextmanager
def recording_exit_handlers():
    """Remember the ``atexit`` handlers registered inside (the warm server's imports): a fork that
    drops its parent's handlers gets these back, as a fresh process importing the same modules has them."""
    register = atexit.register

    def recording(func, *args, **kwargs):
        _import_time_exit_handlers.append((func, args, kwargs))
        return register(func, *args, **kwargs)

    atexit.register = recording
    try:
        yield
    finally:
        atexit.register = register


_DEFAULT_HANDLERS = {signal.SIGINT: signal.default_int_handler, signal.SIGPIPE: signal.SIG_IGN}


class SignalledByPid:
    """``send_signal``, ``terminate`` and ``kill`` of a ``Popen``-like child with ``pid`` and ``poll``."""

    pid: int

    def poll(self) -> int | None:
        raise NotImplementedError

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkedProcess(SignalledByPid):
    """The ``subprocess.Popen`` surface of a forked child: ``pid``, ``returncode``, ``stdout``,
    ``poll``, ``wait``, ``send_signal``, ``terminate``, ``kill``."""

    def __init__(self, pid: int, args: list[str], stdout: io.TextIOBase | None = None):
        self.pid, self.args, self.stdout = pid, args, stdout
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self._reap(os.WNOHANG)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if timeout is None:
            while self.returncode is None:
                self._reap(0)
            return self.returncode
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.01)
        return self.returncode

    def _reap(self, flags: int) -> None:
        try:
            pid, status = os.waitpid(self.pid, flags)
        except ChildProcessError:  # reaped elsewhere: what Popen reports then
            self.returncode = 0
            return
        if pid:
            self.returncode = os.waitstatus_to_exitcode(status)


def fork_module(module: str, argv: list[str], *, env: dict[str, str], stdout_fd: int | None = None,
                stderr_fd: int | None = None, new_session: bool = False, cwd: str | None = None,
                keep_atexit: bool = False, close_fds: tuple[int, ...] = (),
                before: Callable[[], None] | None = None) -> int:
    """Fork; the child runs ``python -m module *argv`` in this interpreter and never returns.

    Args:
        env: the child's whole environment.
        stdout_fd, stderr_fd: what becomes the child's fd 1 and 2 (None: inherit).
        close_fds: raw descriptors (no Python object owns them) the child closes after that.
        new_session: ``setsid`` in the child, as ``Popen(start_new_session=True)``.
        keep_atexit: keep the ``atexit`` handlers registered so far (the warm server's are only those
            its imports registered, which a fresh process importing the same modules has too);
            otherwise the child starts with only those import-time ones (:func:`recording_exit_handlers`):
            the parent's own are the parent's business.
        before: called in the child right before the module runs.

    Returns:
        the child's pid (in the parent).
    """
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        _become_child(env, stdout_fd, stderr_fd, new_session, cwd, keep_atexit, close_fds)
        if before is not None:
            before()
        code = _run_main(module, argv)
    except BaseException:  # noqa: BLE001 - setting the child up failed: say why, exit 1
        traceback.print_exc()
    finally:
        os._exit(code)


def _become_child(env: dict[str, str], stdout_fd: int | None, stderr_fd: int | None, new_session: bool,
                  cwd: str | None, keep_atexit: bool, close_fds: tuple[int, ...]) -> None:
    global forked
    forked = True
    if new_session:
        os.setsid()
    for target, fd in ((1, stdout_fd), (2, stderr_fd)):
        if fd is not None and fd != target:
            os.dup2(fd, target)
    for fd in set(close_fds) - {0, 1, 2}:
        os.close(fd)
    signal.set_wakeup_fd(-1)
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        handler = signal.getsignal(sig)
        default = _DEFAULT_HANDLERS.get(sig, signal.SIG_DFL)
        if handler is not None and handler is not default:
            signal.signal(sig, default)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    if not keep_atexit:
        atexit._clear()
        weakref.finalize._registered_with_atexit = False  # the next finalizer registers again, here
        for func, args, kwargs in _import_time_exit_handlers:
            atexit.register(func, *args, **kwargs)
    os.environ.clear()
    os.environ.update(env)
    if cwd:
        os.chdir(cwd)
    # fresh standard streams: the parent's may have been locked by one of its other threads at the fork
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    sys.stdout = sys.__stdout__ = _text_stream(1, unbuffered)
    sys.stderr = sys.__stderr__ = _text_stream(2, True)
    if "torch" in sys.modules and env.get("OMP_NUM_THREADS", "").isdigit():
        sys.modules["torch"].set_num_threads(int(env["OMP_NUM_THREADS"]))


def _text_stream(fd: int, write_through: bool) -> io.TextIOWrapper:
    return io.TextIOWrapper(io.BufferedWriter(io.FileIO(fd, "w", closefd=False)), encoding="utf-8",
                            errors="backslashreplace", line_buffering=True, write_through=write_through)


def _run_main(module: str, argv: list[str]) -> int:
    """Run ``module`` as ``__main__`` and end as the interpreter would: the exit code."""
    sys.argv = [module, *argv]
    # runpy's note that ``module`` was imported (by the warm server) before it runs as __main__: expected here
    warnings.filterwarnings("ignore", message=".*found in sys.modules after import of package", category=RuntimeWarning)
    interrupted = False
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as stop:
        code = _exit_code(stop.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        code, interrupted = 1, True
    except BaseException:  # noqa: BLE001 - what the interpreter does with an uncaught exception
        traceback.print_exc()
        code = 1
    from components.core.runtime.stepcli import wind_down

    wind_down()
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code


def _exit_code(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def module_of(cmd: list[str]) -> tuple[str, list[str]] | None:
    """``(module, argv)`` of ``[python, (-u,) -m, module, *argv]`` run by this interpreter, else None."""
    if not cmd or os.path.realpath(cmd[0]) != os.path.realpath(sys.executable):
        return None
    rest = list(cmd[1:])
    if rest[:1] == ["-u"]:
        rest = rest[1:]
    if len(rest) < 2 or rest[0] != "-m":
        return None
    return rest[1], rest[2:]


def start_python(cmd: list[str], *, env: dict[str, str], new_session: bool = False,
                 before: Callable[[], None] | None = None) -> subprocess.Popen | ForkedProcess:
    """Start ``cmd`` with its stdout and stderr on one text pipe (``.stdout``): a fork of this process
    when it is warm and ``cmd`` is ``python -m module ...``, else ``subprocess.Popen``."""
    target = module_of(cmd) if forked else None
    if target is None:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                env=env, start_new_session=new_session)
    read_end, write_end = os.pipe()
    try:
        pid = fork_module(target[0], target[1], env=env, stdout_fd=write_end, stderr_fd=write_end,
                          new_session=new_session, close_fds=(read_end, write_end), before=before)
    finally:
        os.close(write_end)
    return ForkedProcess(pid, cmd, open(read_end, encoding="utf-8", errors="replace"))


def fork_workers() -> None:
    """Make torch elastic fork its ``python -u -m <module>`` workers from this (warm) agent."""
    from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

    handler = subprocess_handler.SubprocessHandler
    if getattr(handler, "_relaunch_forks", False):
        return
    popen = handler._popen

    def fork_or_popen(self, args: tuple, env: dict[str, str]):
        target = module_of([str(a) for a in args])
        if target is None:
            return popen(self, args, env)
        pid = fork_module(target[0], target[1], env=env, new_session=True,
                          stdout_fd=self._stdout.fileno() if self._stdout else None,
                          stderr_fd=self._stderr.fileno() if self._stderr else None)
        return ForkedProcess(pid, list(args))

    handler._popen = fork_or_popen
    handler._relaunch_forks = True
