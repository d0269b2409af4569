"""The module the warm-runtime tests start (a zygote's fork, or cold): it reports what it was given (argv,
environment, ids, descriptors, threads, signal dispositions) as one JSON line and ends as its first argument says.

    python -m tests.core.warm_child exit 3 | raise | sigkill | interrupt | wait-term | sleep SECONDS
"""

import atexit
import json
import os
import signal
import sys
import threading
import time


def _fds() -> dict[str, str]:
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the descriptor listdir itself used
            pass
    return out


if __name__ == "__main__":
    how = sys.argv[1]
    atexit.register(print, "child atexit ran", flush=True)
    print(json.dumps({"argv": sys.argv[1:], "env": os.environ.get("WARM_PROBE"), "pid": os.getpid(),
                      "ppid": os.getppid(), "sid": os.getsid(0), "main": __name__, "cwd": os.getcwd(),
                      "fds": _fds(), "threads": threading.active_count(),
                      "os_threads": len(os.listdir("/proc/self/task")),
                      "sigterm": str(signal.getsignal(signal.SIGTERM)), "sigint": str(signal.getsignal(signal.SIGINT)),
                      "nice": os.getpriority(os.PRIO_PROCESS, 0), "warm": "torch" in sys.modules,
                      "dynamo": "torch._dynamo" in sys.modules,
                      "cuda": "torch" in sys.modules and sys.modules["torch"].cuda.is_initialized()}), flush=True)
    if how == "exit":
        sys.exit(int(sys.argv[2]))
    if how == "raise":
        raise RuntimeError("boom from the warm child")
    if how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "interrupt":
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(30)
    if how == "wait-term":  # a trainer's preemption path: SIGTERM -> exit 143
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        print("ready", flush=True)
        time.sleep(60)
        sys.exit(0)
    if how == "sleep":
        print("ready", flush=True)
        time.sleep(float(sys.argv[2]))
