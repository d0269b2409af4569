"""The one private name of the Python standard library relaunch uses, ``atexit._run_exitfuncs``
(components/core/runtime/stdlib_private.py, why there), with what relaunch relies on: a Python whose
``atexit`` lacks it, or whose runner no longer runs every handler, fails here by name. And the
documented negative entry of ``sys.modules`` that replaced no private name but is pinned alike
(components/core/tracking/runlogger.py ``remember_absent``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


def test_a_process_that_ends_through_end_process_runs_every_atexit_handler_last_registered_first(tmp_path):
    """A step or a worker that ends through ``end_process`` runs its atexit handlers (a pending async
    save's, MLflow's, those registered before relaunch was imported) and then skips the interpreter's
    module teardown; a failing handler does not keep the others from running."""
    log = tmp_path / "ran"
    done = _run("import atexit\n"
                f"log = open({str(log)!r}, 'a', buffering=1)\n"
                "atexit.register(print, 'before-import', file=log)\n"
                "from relaunch.components.core.runtime.stepcli import end_process\n"
                "atexit.register(print, 'after-import', file=log)\n"
                "atexit.register(lambda: 1 / 0)\n"
                "end_process(3)\n")
    assert done.returncode == 3, done.stderr
    assert log.read_text().splitlines() == ["after-import", "before-import"]
    assert "ZeroDivisionError" in done.stderr


def test_the_exit_handlers_run_once_even_when_the_interpreter_exits_normally_afterwards(tmp_path):
    """A warm child runs the handlers through ``wind_down`` and may then leave as usual: none runs twice."""
    log = tmp_path / "ran"
    done = _run("import atexit\n"
                f"log = open({str(log)!r}, 'a', buffering=1)\n"
                "atexit.register(print, 'handler', file=log)\n"
                "from relaunch.components.core.runtime.stepcli import wind_down\n"
                "wind_down()\n")
    assert done.returncode == 0, done.stderr
    assert log.read_text().splitlines() == ["handler"]


def test_a_module_remembered_as_absent_fails_to_import_at_once_and_probes_as_not_installed():
    done = _run("import importlib.util, sys\n"
                "from relaunch.components.core.tracking.runlogger import remember_absent\n"
                "remember_absent(('relaunch_surely_not_installed', 'json'))\n"
                "try:\n"
                "    import relaunch_surely_not_installed\n"
                "except ModuleNotFoundError:\n"
                "    print('refused')\n"
                "print(importlib.util.find_spec('relaunch_surely_not_installed'))\n"
                "import json\n"
                "print(json.dumps(1))\n")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["refused", "None", "1"]
