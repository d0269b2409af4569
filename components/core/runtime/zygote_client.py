"""The worker command of a warm node: ask the node's zygote to fork ``python -m MODULE ARGS`` and be that
process for whoever started us (torchrun's agent, the local launcher).

    RELAUNCH_ZYGOTE=/tmp/relaunch-zygote/socket python -I -S zygote_client.py -m relaunch.components.train --config-json J

Standard library only, run isolated (``-I -S``: no site, no user paths, ~30 ms): it must not cost what it
saves. It passes its stdin, stdout and stderr (SCM_RIGHTS), argv, environment and working directory to the
zygote (:mod:`relaunch.components.core.runtime.zygote`), forwards SIGTERM, SIGINT, SIGHUP, SIGUSR1 and SIGUSR2 to the
worker, and ends exactly as the worker did: the same exit code, or death by the same signal (so torchrun
sees -9 for a SIGKILLed worker and 143 for a preempted one, as cold). If it is killed itself, the zygote
kills the worker. With no zygote (unset, gone, refusing) it replaces itself with the cold worker,
``python -u -m MODULE ARGS``, and says so in one line on stderr.
"""

import json
import os
import signal
import socket
import struct
import sys

ZYGOTE_ENV = "RELAUNCH_ZYGOTE"
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
HEADER = struct.Struct("!Q")


def _cold(argv, reason):
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)  # exec keeps the mask
    print(f"relaunch zygote client: {reason}; starting the worker cold", file=sys.stderr, flush=True)
    os.execv(sys.executable, [sys.executable, "-u", *argv])


def _lines(conn):
    buffer = b""
    while True:
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            yield json.loads(line)
        chunk = conn.recv(4096)
        if not chunk:
            return
        buffer += chunk


def _end_as(status):
    """Exit with ``status`` (a raw wait status): the same code, or death by the same signal."""
    code = os.waitstatus_to_exitcode(status)
    if code >= 0:
        os._exit(code)
    sig = -code
    for forwarded in {*FORWARDED, sig} - {signal.SIGKILL, signal.SIGSTOP}:
        signal.signal(forwarded, signal.SIG_DFL)
    os.kill(os.getpid(), sig)
    os._exit(128 + sig)  # a signal whose default is not to end the process


def main(argv):
    """Run ``argv`` (``-m MODULE ARGS``) as a fork of the zygote; never returns."""
    if len(argv) < 2 or argv[0] != "-m":
        print("usage: python -I -S zygote_client.py -m MODULE [ARGS...]", file=sys.stderr)
        os._exit(2)
    path = os.environ.get(ZYGOTE_ENV)
    if not path:
        _cold(argv, f"{ZYGOTE_ENV} is not set")
    # held until the worker's pid is known, then forwarded: a SIGTERM in between must reach it
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    body = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    try:
        conn.connect(path)
        socket.send_fds(conn, [HEADER.pack(len(body))], [0, 1, 2])
        conn.sendall(body)
        lines = _lines(conn)
        started = next(lines, None)
    except OSError as err:
        started, reason = None, f"cannot reach the zygote at {path} ({err})"
    else:
        reason = "the zygote ended before it forked" if started is None else started.get("refused")
    if started is None or "pid" not in started:
        conn.close()
        _cold(argv, reason)
    pid = started["pid"]

    def forward(signum, _frame):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
    ended = next(lines, None)
    if ended is None or "status" not in ended:  # the zygote died: its workers die with it (PDEATHSIG)
        print(f"relaunch zygote client: lost the zygote while worker {pid} ran: "
              f"{(ended or {}).get('lost', 'it ended')}", file=sys.stderr, flush=True)
        _end_as(signal.SIGKILL)
    _end_as(ended["status"])


if __name__ == "__main__":
    main(sys.argv[1:])
