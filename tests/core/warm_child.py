"""The module tests/core/test_warm.py starts as a warm fork: it reports what it was given and ends
the way its first argument says."""

import atexit
import json
import os
import sys

if __name__ == "__main__":
    how = sys.argv[1]
    atexit.register(print, "child atexit ran", flush=True)
    print(json.dumps({"argv": sys.argv[1:], "env": os.environ.get("WARM_PROBE"), "pid": os.getpid(),
                      "ppid": os.getppid(), "sid": os.getsid(0), "main": __name__}), flush=True)
    if how == "exit":
        sys.exit(int(sys.argv[2]))
    if how == "raise":
        raise RuntimeError("boom from the warm child")
    if how == "sigkill":
        os.kill(os.getpid(), 9)
