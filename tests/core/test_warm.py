"""A warm start (components/core/runtime/warm.py) behaves as ``python -m module`` would: the child gets its
own argv, environment, session and output, ends with the exit status the interpreter would give,
runs only its own ``atexit`` handlers, and is a real child of the process that started it.

Forking the test process itself is what the launch step does, but pytest's process has threads and
has run torch; each case therefore forks from a fresh interpreter (``_in_a_fresh_process``)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from components.core.runtime import warm

ROOT = Path(__file__).resolve().parents[2]

_STARTER = textwrap.dedent("""
    import atexit, json, os, sys
    from components.core.runtime import warm
    atexit.register(print, "PARENT ATEXIT RAN IN THE CHILD", flush=True)
    warm.forked = True
    how = sys.argv[1:]
    proc = warm.start_python([sys.executable, "-u", "-m", "tests.core.warm_child", *how],
                             env={**os.environ, "WARM_PROBE": "given"}, new_session=True)
    output = proc.stdout.read()
    code = proc.wait()
    atexit.unregister(print)
    print(json.dumps({"kind": type(proc).__name__, "code": code, "output": output, "parent": os.getpid(),
                      "parent_sid": os.getsid(0)}))
""")


def _last_line_of_a_fresh_process(script: str, *args: str) -> dict:
    """Run ``script`` in a fresh interpreter; the JSON it printed last."""
    done = subprocess.run([sys.executable, "-c", script, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _in_a_fresh_process(*how: str) -> dict:
    return _last_line_of_a_fresh_process(_STARTER, *how)


def _reported(result: dict) -> dict:
    return json.loads(next(line for line in result["output"].splitlines() if line.startswith("{")))


def test_a_warm_start_runs_the_module_as_main_with_its_own_argv_env_and_session():
    result = _in_a_fresh_process("exit", "0")
    child = _reported(result)
    assert result["kind"] == "ForkedProcess" and result["code"] == 0
    assert child["argv"] == ["exit", "0"] and child["env"] == "given" and child["main"] == "__main__"
    assert child["ppid"] == result["parent"]  # a real child: its parent can wait for it and signal it
    assert child["sid"] == child["pid"] != result["parent_sid"]  # start_new_session, as Popen does


@pytest.mark.parametrize("how, code", [(("exit", "3"), 3), (("exit", "138"), 138), (("raise",), 1),
                                       (("sigkill",), -9)])
def test_a_warm_start_ends_with_the_status_the_interpreter_would_give(how, code):
    result = _in_a_fresh_process(*how)
    assert result["code"] == code
    if how == ("raise",):
        assert "RuntimeError: boom from the warm child" in result["output"]


def test_a_warm_child_runs_its_own_atexit_handlers_and_not_its_parents():
    output = _in_a_fresh_process("exit", "0")["output"]
    assert "child atexit ran" in output
    assert "PARENT ATEXIT RAN IN THE CHILD" not in output


def test_a_cold_process_starts_python_as_popen_does():
    """Outside a warm fork (an Argo pod, the test process) ``start_python`` is ``subprocess.Popen``."""
    assert not warm.forked
    proc = warm.start_python([sys.executable, "-u", "-m", "tests.core.warm_child", "exit", "5"],
                             env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "WARM_PROBE": "cold"})
    output = proc.stdout.read()
    assert isinstance(proc, subprocess.Popen) and proc.wait() == 5
    assert json.loads(output.splitlines()[0])["env"] == "cold"


def test_only_python_dash_m_of_this_interpreter_is_forked():
    assert warm.module_of([sys.executable, "-u", "-m", "components.train", "--x"]) == ("components.train", ["--x"])
    assert warm.module_of([sys.executable, "-m", "pkg.mod"]) == ("pkg.mod", [])
    assert warm.module_of(["/usr/bin/env", "-m", "pkg.mod"]) is None
    assert warm.module_of([sys.executable, "script.py"]) is None
    assert warm.module_of([sys.executable, "-c", "print(1)"]) is None


_AGENT = textwrap.dedent("""
    import json, os, sys
    from components.core.runtime import warm
    from torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler import SubprocessHandler
    warm.forked = True
    warm.fork_workers()
    handler = SubprocessHandler(sys.executable, ("-u", "-m", "tests.core.warm_child", "exit", "7"),
                                {"WARM_PROBE": "worker"}, stdout=sys.argv[1], stderr=None, local_rank_id=0,
                                numa_options=None)
    code = handler.proc.wait()
    print(json.dumps({"kind": type(handler.proc).__name__, "code": code, "agent": os.getpid()}))
""")


def test_a_warm_agent_forks_its_workers_with_the_environment_and_output_torch_elastic_gives(tmp_path):
    out = tmp_path / "worker.out"
    agent = _last_line_of_a_fresh_process(_AGENT, str(out))
    worker = json.loads(out.read_text().splitlines()[0])
    assert (agent["kind"], agent["code"]) == ("ForkedProcess", 7)
    assert worker["env"] == "worker" and worker["ppid"] == agent["agent"] and worker["sid"] == worker["pid"]
