"""Stopping ``relaunch run`` cleanly: Ctrl-C (SIGINT) or SIGTERM to the CLI process, and only to it,
ends every process the run started (steps, warm servers, torchrun agents in their own sessions,
workers) and leaves one line, never a traceback.

    with interruptible():          # SIGINT/SIGTERM raise Interrupted; this process reaps orphans;
        try:                       # a guardian kills everything the run started if it dies (SIGKILL)
            ...                    # start the pipeline
        except Interrupted:
            stop_descendants(30)   # SIGTERM (a preemption checkpoint), then SIGKILL what is left

Deliberately light (no kfp, torch or MLflow import), so that it is in place before the slow imports.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import time
from typing import Iterable

PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>
PR_GET_CHILD_SUBREAPER = 37
STOP_MARGIN_SECONDS = 10.0
"""Beyond the preemption grace: how long the run's processes get to commit their checkpoint and end."""


class Interrupted(BaseException):
    """``relaunch run`` was sent SIGINT (Ctrl-C) or SIGTERM. A BaseException, as KeyboardInterrupt is,
    so that no ``except Exception`` of kfp.local's or ours keeps the run going."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.at = time.time()


@contextlib.contextmanager
def interruptible():
    """While inside: SIGINT and SIGTERM raise :class:`Interrupted` (once; a second signal during the
    clean-up is ignored), and this process is the child subreaper of everything it starts (Linux
    ``PR_SET_CHILD_SUBREAPER``), so a process whose parent died (a torchrun agent of a killed launch
    step) stays a descendant that :func:`stop_descendants` finds, instead of training on under PID 1.
    A guardian (:mod:`relaunch.pipelines.local.guardian`) kills every process of the run the moment this one
    dies without the chance to do it itself (SIGKILL, OOM). On the way out this process is again
    what it was (a subreaper or not), and the orphans it adopted that have ended are reaped: a
    caller that goes on (a test, a notebook) is not left adopting, and never reaping, the orphans of
    whatever it starts later."""
    from .guardian import guard

    def handle(signum, _frame):
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        raise Interrupted(signum)

    global _guardian_pid, _children_before
    was_subreaper = is_subreaper()
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    previous = {sig: signal.signal(sig, handle) for sig in (signal.SIGINT, signal.SIGTERM)}
    before = _children_before = children()
    guardian = guard()
    _guardian_pid = guardian.process.pid if guardian else None
    try:
        yield
    finally:
        if guardian is not None:
            guardian.close()
            _guardian_pid = None
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if not was_subreaper:
            _prctl(PR_SET_CHILD_SUBREAPER, 0)
        reap_ended_children(spare=before)
        _children_before = set()


_guardian_pid: int | None = None  # the guardian of the run inside interruptible(): never stopped with the rest
_children_before: set[int] = set()  # this process's children when interruptible() was entered


def _prctl(option: int, value: int) -> None:
    with contextlib.suppress(OSError, AttributeError):  # not Linux: no subreaper, the tree walk remains
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(option, value, 0, 0, 0)


def is_subreaper() -> bool:
    """Whether this process is a child subreaper now (False where prctl cannot tell)."""
    flag = ctypes.c_int(0)
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(flag), 0, 0, 0)
    return bool(flag.value)


def children() -> set[int]:
    """The pids of this process's children now (from ``/proc``; empty without it)."""
    from ...components.core.store.procfs import processes

    me = os.getpid()
    return {pid for pid, fields in processes() if int(fields[1]) == me}  # the ppid


def reap_ended_children(spare: set[int]) -> list[int]:
    """Reap this process's children that have ended (zombies), but those in ``spare``: the children it
    had before a run, whose own ``Popen`` may still wait for them, keep their status; what is left
    are the orphans adopted as subreaper during the run, whose status nobody else waits for.
    Returns the pids reaped."""
    from ...components.core.store.procfs import exited, processes

    me, reaped = os.getpid(), []
    for pid, fields in processes():
        if int(fields[1]) == me and pid not in spare and exited(fields):
            with contextlib.suppress(ChildProcessError):
                if os.waitpid(pid, os.WNOHANG)[0]:
                    reaped.append(pid)
    return reaped


def stop_descendants(grace_seconds: float, spare: Iterable[int] = ()) -> int:
    """Stop every process this one started, however deep (steps, torchrun agents in their own
    sessions, workers): SIGTERM, which lets the training commit a preemption checkpoint, then SIGKILL
    to whatever is left after ``grace_seconds``. A process that appears meanwhile (a worker group
    restarting) is sent SIGTERM too. The processes in ``spare`` (the warm servers, which end when
    closed and must outlive their steps) and the run's guardian are left alone, their children are not.
    Returns how many processes were stopped; when it returns, every process but the spared has ended."""
    import psutil

    me = psutil.Process()
    spared = {*spare, *([_guardian_pid] if _guardian_pid else [])}
    signalled: dict[int, psutil.Process] = {}
    deadline = time.monotonic() + grace_seconds
    while True:
        for child in _descendants(me, spared):
            if child.pid not in signalled:
                signalled[child.pid] = child
                with contextlib.suppress(psutil.Error):
                    child.send_signal(signal.SIGTERM)
        _reap()
        alive = [p for p in signalled.values() if _running(p)]
        if not alive and not _descendants(me, spared):
            return len(signalled)
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for child in [*alive, *_descendants(me, spared)]:
        with contextlib.suppress(psutil.Error):
            child.kill()
    psutil.wait_procs(alive, timeout=5)
    _reap()
    return len(signalled)


def _descendants(me, spared: set[int]) -> list:
    import psutil

    with contextlib.suppress(psutil.Error):
        return [p for p in me.children(recursive=True) if p.pid not in spared and _running(p)]
    return []


def _running(process) -> bool:
    import psutil

    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _reap() -> None:
    """Collect the exit status of every ended child (as subreaper, orphans are our children), but of
    those this process had before the run (:func:`interruptible`): their own ``Popen`` waits for them."""
    reap_ended_children(spare=_children_before)
