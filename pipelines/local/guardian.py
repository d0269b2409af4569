"""The guardian of one ``relaunch run``: the moment the run's own process ends, however it ended (SIGKILL
included), it kills every process the run started, however deep (warm servers, steps, torchrun agents in
their own sessions, zygote clients, workers) and whoever their parent is by then.

    python -I -S guardian.py RUN_PID FD TOKEN      # what guard() starts: standard library only

The run sets ``RELAUNCH_RUN_TOKEN=<TOKEN>`` (unique per run) in its environment before it starts anything,
so every process of the run carries it in the environment the kernel shows in ``/proc/<pid>/environ``:
children inherit it, and a fork (a warm server's step or worker) shows its exec'd ancestor's, which has it.
The guardian, in a session of its own (a Ctrl-C or a kill of the run's process group does not reach it),
waits on a pidfd of the run (its death) and on the read end of a pipe only the run holds (its orderly
end, :meth:`Guard.close`); then it SIGKILLs every process whose environment holds the token, pass after
pass until a pass finds none (a process forking as it dies is caught by the next), and exits.

Why one guardian rather than ``PR_SET_PDEATHSIG`` in each child: that signal follows the parent *thread*
that forked the child, and kfp.local and torchrun start children from threads we do not control; it would
need code in processes that are not ours (torchrun's agents, kfp's ``sh``), with a race at each of the five
levels; and an orphan reparented to a subreaper is out of every tree walk. The token finds a process
wherever it ended up, cold or warm. A process group or cgroup was not an option: the agents and workers
need their own sessions (the launcher stops an agent with its workers by group), and a writable cgroup
is not given everywhere. Killed workers cannot damage the store: a checkpoint counts only once its
manifest is committed, and their write lease is taken over once their pid is gone. (A process that execs
with an environment of its own making, ``env -i``, would escape; nothing relaunch starts does.)
"""

import os
import select
import signal
import sys
import time

TOKEN_ENV = "RELAUNCH_RUN_TOKEN"
SWEEP_SECONDS = 10.0
"""How long the guardian keeps sweeping while processes of the run keep appearing (a bound, never reached
in practice: a pass takes milliseconds and the second one finds nothing)."""


def _holding(token: bytes) -> list[int]:
    """The processes (other than this one) whose environment holds ``TOKEN_ENV=token``."""
    me, found = os.getpid(), []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as fh:
                if token in fh.read().split(b"\0"):
                    found.append(int(name))
        except OSError:  # gone meanwhile, a zombie, or another user's
            continue
    return found


def sweep(token: str) -> int:
    """SIGKILL every process of the run ``token`` names until none is left; how many were killed."""
    entry = f"{TOKEN_ENV}={token}".encode()
    killed: set[int] = set()
    deadline = time.monotonic() + SWEEP_SECONDS
    while time.monotonic() < deadline:
        found = _holding(entry)
        if not found:
            break
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except OSError:
                pass
        time.sleep(0.02)  # let the killed ones die (a dead one's environment reads empty)
    return len(killed)


def main(argv: list[str]) -> None:
    run_pid, fd, token = int(argv[0]), int(argv[1]), argv[2]
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):  # only the run's end ends the guardian
        signal.signal(sig, signal.SIG_IGN)
    watched = [fd]
    try:
        watched.append(os.pidfd_open(run_pid))
    except (OSError, AttributeError):  # no pidfds (Linux < 5.3): the pipe alone, which a leaked fork may hold
        pass
    if os.getppid() == run_pid:  # else the run died before the pidfd was opened: sweep at once
        select.select(watched, [], [])
    killed = sweep(token)
    if killed:
        print(f"relaunch guardian: the run (pid {run_pid}) ended; killed {killed} process(es) it had started",
              file=sys.stderr, flush=True)
    os._exit(0)


class Guard:
    """The guardian of this process's run, started by :func:`guard`."""

    def __init__(self, process, write_end: int):
        self.process, self._write_end = process, write_end

    def close(self, timeout: float = 10.0) -> None:
        """The run ends in order: the guardian sweeps what is left (nothing, normally) and exits; idempotent."""
        if self._write_end is None:
            return
        os.close(self._write_end)
        self._write_end = None
        os.environ.pop(TOKEN_ENV, None)
        try:
            self.process.wait(timeout)
        except Exception:  # noqa: BLE001 - a guardian that hangs must not hold the run's exit
            self.process.kill()


def guard() -> "Guard | None":
    """Start this process's guardian and put its token in the environment (before anything else starts);
    None where it cannot run (not Linux: no ``/proc``)."""
    import subprocess
    import uuid

    if not sys.platform.startswith("linux"):
        return None
    token = f"{os.getpid()}-{uuid.uuid4().hex}"
    read_end, write_end = os.pipe()
    try:
        process = subprocess.Popen([sys.executable, "-I", "-S", __file__, str(os.getpid()), str(read_end), token],
                                   pass_fds=(read_end,), stdin=subprocess.DEVNULL, start_new_session=True,
                                   env={k: v for k, v in os.environ.items() if k != TOKEN_ENV})
    except OSError:
        os.close(write_end)
        return None
    finally:
        os.close(read_end)
    os.environ[TOKEN_ENV] = token
    return Guard(process, write_end)


if __name__ == "__main__":
    main(sys.argv[1:])
