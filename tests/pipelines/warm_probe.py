"""The module the shared warm server tests fork (tests/pipelines/test_shared_warm_steps.py): imported by the
server, it caches the server's temporary folder (as a server that made one for a step has); run as a step,
it reports what the step was given as one JSON line.

    python -m tests.pipelines.warm_probe
"""

import importlib.util
import json
import os
import sys
import tempfile

SERVER_TEMP = tempfile.gettempdir()

if __name__ == "__main__":
    print(json.dumps({"probe": os.environ.get("WARM_PROBE"), "cwd": os.getcwd(), "path0": sys.path[0],
                      "temp": tempfile.gettempdir(), "ppid": os.getppid(),
                      "local": importlib.util.find_spec("only_in_the_runs_folder") is not None}), flush=True)
