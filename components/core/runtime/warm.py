"""Warm steps: run a ``python -m`` module as a fork of a process that already imported what it needs.

A local ``relaunch run`` is mostly interpreter start-up: every step is a fresh Python that imports kfp,
MLflow (and its SQL store) and torch again, seconds each on a small machine. :mod:`relaunch.pipelines.local.warm_steps`
imports them once in single-threaded server processes and forks every kfp.local step from one of them with
:func:`fork_module`; a step forked that way is *warm* (:data:`forked` is true). Torchrun agents and workers
are never forked from a step: the local launcher starts them through per-node zygotes
(:mod:`relaunch.components.core.runtime.zygote`), as a pod does.

The fork is a real child of the server: its own stdout/stderr, environment, working directory and
``sys.argv``, default signal handlers and mask, no descriptor of the server but the ones it is given,
the ``atexit`` handlers of its imports (a fresh process importing the same modules has them), and the
exit status Python itself would give (``SystemExit`` code, 1 for an uncaught exception, death by SIGINT
for Ctrl-C).
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import os
import runpy
import signal
import sys
import tempfile
import traceback
import warnings

forked = False
"""True in a process forked from a warm server (and in the processes it forks in turn)."""


_PR_SET_PDEATHSIG = 1
_DEFAULT_HANDLERS = {signal.SIGINT: signal.default_int_handler, signal.SIGPIPE: signal.SIG_IGN}


def die_with_parent(parent: int) -> None:
    """In a child forked by ``parent``: die by SIGKILL when ``parent`` dies (Linux ``PR_SET_PDEATHSIG``,
    through libc's public ``prctl``), and now if it already died between the fork and this call (the
    signal is only armed for a parent still there). The parent must be single-threaded, or the thread that
    forked must live as long as it: the signal follows the forking *thread*."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux: the run's guardian remains
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)


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


def fork_module(module: str, argv: list[str], *, env: dict[str, str], stdout_fd: int | None = None,
                stderr_fd: int | None = None, new_session: bool = False, cwd: str | None = None,
                close_fds: tuple[int, ...] = ()) -> int:
    """Fork; the child runs ``python -m module *argv`` in this interpreter and never returns.

    Args:
        env: the child's whole environment.
        stdout_fd, stderr_fd: what becomes the child's fd 1 and 2 (None: inherit).
        close_fds: kept for callers; the child closes every descriptor above 2 after the redirection.
        new_session: ``setsid`` in the child, as ``Popen(start_new_session=True)``.

    Returns:
        the child's pid (in the parent).
    """
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    parent = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        die_with_parent(parent)  # nothing of a run outlives its server
        _become_child(env, stdout_fd, stderr_fd, new_session, cwd, close_fds)
        code = _run_main(module, argv)
    except BaseException:  # noqa: BLE001 - setting the child up failed: say why, exit 1
        traceback.print_exc()
    finally:
        os._exit(code)


def _become_child(env: dict[str, str], stdout_fd: int | None, stderr_fd: int | None, new_session: bool,
                  cwd: str | None, close_fds: tuple[int, ...]) -> None:
    global forked
    forked = True
    if new_session:
        os.setsid()
    for target, fd in ((1, stdout_fd), (2, stderr_fd)):
        if fd is not None and fd != target:
            os.dup2(fd, target)
    for fd in set(close_fds) - {0, 1, 2}:
        os.close(fd)
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # fork keeps every descriptor, CLOEXEC or not: none of the server's
    signal.set_wakeup_fd(-1)
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        handler = signal.getsignal(sig)
        default = _DEFAULT_HANDLERS.get(sig, signal.SIG_DFL)
        if handler is not None and handler is not default:
            signal.signal(sig, default)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None  # found again from this environment's TMPDIR, not the server's
    if cwd:
        os.chdir(cwd)
        if sys.path and not sys.flags.safe_path:  # ``python -m`` puts the working directory first (a shared
            sys.path[0] = os.getcwd()            # server started elsewhere: the step's, not the server's)
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
    from .stepcli import wind_down

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
