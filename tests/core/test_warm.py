"""The warm runtime: a worker forked by the node's zygote (components/core/runtime/zygote.py) through its
stdlib client behaves as ``python -m module`` would for whoever started the client (torchrun's agent):
its own argv, environment, working directory, session and streams, no descriptor of its parents, default
signals, SIGTERM forwarded, and the exact exit status (death by the same signal included). The zygote forks
only while single-threaded; without it the client starts the worker cold. The warm step servers
(pipelines/local/warm_steps.py) reap their steps on Ctrl-C, report 130 for an interrupted step, survive a
requester that left, never report an unreadable status as success, and run at the run's own priority.

Each case starts real processes: a zygote (one per module, a fresh interpreter), the client, torchrun."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from relaunch.components.core.contract.exitcodes import normalize
from relaunch.components.core.runtime.zygote import Zygote, client_command
from relaunch.pipelines.local.warm_steps import RemoteProcess, _reap

ROOT = Path(__file__).resolve().parents[2]
CHILD = ["-m", "tests.core.warm_child"]


@pytest.fixture(scope="module")
def zygote(tmp_path_factory):
    directory = tmp_path_factory.mktemp("zygote")
    started = Zygote(str(directory / "socket"), ("tests.core.warm_child",), log=open(directory / "log", "w"),
                     env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=str(ROOT))
    yield started
    started.close()


def _env(zygote: Zygote | None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RELAUNCH_ZYGOTE"}
    env.update({"PYTHONPATH": str(ROOT), "WARM_PROBE": "given", **extra})
    return {**env, **(zygote.env if zygote else {})}


def _client(zygote: Zygote | None, *how: str, cwd: Path = ROOT, **popen) -> subprocess.Popen:
    return subprocess.Popen([*client_command(), *CHILD, *how], env=_env(zygote), cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **popen)


def _report(proc: subprocess.Popen) -> dict:
    return json.loads(proc.stdout.readline())


def test_a_forked_worker_runs_the_module_as_main_with_its_own_argv_env_cwd_session_and_no_inherited_fds(zygote, tmp_path):
    proc = _client(zygote, "exit", "0", cwd=tmp_path)
    child = _report(proc)
    assert proc.wait(60) == 0
    assert child["warm"], "the worker was not forked from the zygote (it imported nothing of torch)"
    # the preload's optimiser warm-up imported what a first optimiser would, and touched no CUDA
    assert child["dynamo"] and not child["cuda"]
    assert child["argv"] == ["exit", "0"] and child["env"] == "given" and child["main"] == "__main__"
    assert child["cwd"] == str(tmp_path)
    assert child["sid"] == child["pid"] != proc.pid  # its own session, as torch elastic starts workers
    assert sorted(child["fds"]) == ["0", "1", "2"], child["fds"]  # nothing of the zygote or its clients
    assert child["sigterm"] == str(int(signal.SIG_DFL)) and "default_int_handler" in child["sigint"]


@pytest.mark.parametrize("how, code", [(("exit", "3"), 3), (("exit", "138"), 138), (("raise",), 1),
                                       (("sigkill",), -signal.SIGKILL), (("interrupt",), -signal.SIGINT)])
def test_the_client_ends_with_the_workers_exact_status(zygote, how, code):
    proc = _client(zygote, *how)
    _report(proc)
    assert proc.wait(60) == code
    if how == ("raise",):
        assert "RuntimeError: boom from the warm child" in proc.stderr.read()


def test_sigterm_to_the_client_reaches_the_worker_and_its_exit_code_comes_back(zygote):
    proc = _client(zygote, "wait-term")
    _report(proc)
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 143


def test_a_killed_client_takes_its_worker_down(zygote):
    proc = _client(zygote, "sleep", "60")
    worker = _report(proc)["pid"]
    proc.kill()
    proc.wait(10)
    deadline = time.monotonic() + 30
    while Path(f"/proc/{worker}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{worker}").exists(), "the worker outlived its client"


def test_the_zygote_stays_single_threaded_while_it_serves(zygote):
    proc = _client(zygote, "exit", "0")
    _report(proc)
    proc.wait(60)
    assert len(os.listdir(f"/proc/{zygote.process.pid}/task")) == 1


def test_a_zygote_whose_imports_started_a_thread_refuses_and_the_worker_starts_cold(tmp_path):
    threaded = Zygote(str(tmp_path / "socket"), ("tests.core.threaded_import",), log=open(tmp_path / "log", "w"),
                      env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=str(ROOT))
    try:
        proc = _client(threaded, "exit", "4")
        child = _report(proc)
        assert proc.wait(60) == 4
        assert not child["warm"]
        assert "starting the worker cold" in proc.stderr.read()
    finally:
        threaded.close()


def test_without_a_zygote_the_client_starts_the_worker_cold_and_says_so(tmp_path):
    proc = subprocess.Popen([*client_command(), *CHILD, "exit", "5"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**_env(None), "RELAUNCH_ZYGOTE": str(tmp_path / "no-such-socket")})
    child = _report(proc)
    assert proc.wait(60) == 5 and not child["warm"]
    assert "cannot reach the zygote" in proc.stderr.read()


@pytest.mark.slow
def test_a_torchrun_worker_holds_no_descriptor_of_its_agent_or_the_c10d_store(tmp_path):
    """Agent 0 hosts the c10d store; a worker that kept its listening socket would keep the port alive
    after the agent died. Warm (tests/warm_processes.py) or cold (RELAUNCH_TEST_COLD=1), same answer."""
    from tests import warm_processes
    from tests.services import free_port

    cmd = [str(Path(sys.executable).parent / "torchrun"), "--nnodes=1", "--nproc-per-node=1", "--rdzv-backend=c10d",
           f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-id=fds", "--monitor-interval=0.2", *CHILD, "exit", "0"]
    done = warm_processes.run(cmd, env=_env(None), cwd=ROOT, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    child = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("{")))
    assert child["warm"] != warm_processes.cold()
    extra = {fd: target for fd, target in child["fds"].items() if fd not in ("0", "1", "2")}
    assert not extra, f"the worker inherited {extra}"


# ------------------------------------------------------------------------------ the warm step servers


_CTRL_C = textwrap.dedent("""
    import json, os, signal, sys, time
    from relaunch.pipelines.local.warm_steps import WarmServer
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # this process stands for relaunch run, which handles its Ctrl-C
    server = WarmServer("none", sys.stderr)
    read_end, write_end = os.pipe()
    step = server.start({"kind": "module", "module": "tests.core.warm_child", "argv": ["sleep", "60"],
                         "env": dict(os.environ), "cwd": os.getcwd()}, [write_end, write_end])
    os.close(write_end)
    output = os.fdopen(read_end)
    child = json.loads(output.readline())
    output.readline()  # ready
    os.killpg(0, signal.SIGINT)  # a Ctrl-C in the terminal reaches the whole process group
    code = step.wait(60)
    server.close()
    alive = os.path.exists(f"/proc/{child['pid']}")
    print(json.dumps({"code": code, "child_alive": alive, "server": server.process.returncode}))
""")


def _last_json(script: str) -> dict:
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=_env(None), capture_output=True, text=True,
                          timeout=120, start_new_session=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_ctrl_c_during_a_warm_step_reads_130_and_nothing_is_left_running_after_close():
    result = _last_json(_CTRL_C)
    assert normalize(result["code"]) == 130, result
    assert not result["child_alive"] and result["server"] == 0


_LEFT_EARLY = textwrap.dedent("""
    import json, os, sys
    from relaunch.pipelines.local.warm_steps import WarmServer
    server = WarmServer("none", sys.stderr)
    def start(*argv):
        read_end, write_end = os.pipe()
        step = server.start({"kind": "module", "module": "tests.core.warm_child", "argv": list(argv),
                             "env": dict(os.environ), "cwd": os.getcwd()}, [write_end, write_end])
        os.close(write_end)
        return step, os.fdopen(read_end)
    first, output = start("exit", "0")
    first._status.close()  # the requester leaves before its step ends
    output.read()
    second, output = start("exit", "6")
    output.read()
    code = second.wait(60)
    server.close()
    print(json.dumps({"code": code, "server": server.process.returncode}))
""")


def test_a_requester_that_leaves_early_does_not_take_the_server_down():
    assert _last_json(_LEFT_EARLY) == {"code": 6, "server": 0}


def test_an_exit_status_that_cannot_be_read_is_never_reported_as_success():
    mine, theirs = socket.socketpair()
    stranger = subprocess.Popen([sys.executable, "-c", "pass"])
    stranger.wait()  # reaped here: the server's waitpid gets ECHILD
    _reap(stranger.pid, theirs, None)
    process = RemoteProcess(mine, ["step"])
    process.pid = stranger.pid
    assert process.wait(10) != 0 and normalize(process.returncode) == 137


_PRIORITY = textwrap.dedent("""
    import json, os, sys
    from relaunch.pipelines.local.warm_steps import WarmServer
    server = WarmServer("light", sys.stderr)
    read_end, write_end = os.pipe()
    step = server.start({"kind": "module", "module": "tests.core.warm_child", "argv": ["exit", "0"],
                         "env": dict(os.environ), "cwd": os.getcwd()}, [write_end, write_end])
    os.close(write_end)
    child = json.loads(os.fdopen(read_end).readline())
    step.wait(60)
    server.close()
    print(json.dumps({"step": child["nice"], "run": os.getpriority(os.PRIO_PROCESS, 0)}))
""")


@pytest.mark.slow
def test_warm_steps_run_at_the_priority_of_the_run_as_cold_ones_do():
    result = _last_json(_PRIORITY)
    assert result["step"] == result["run"]


# ------------------------------------------------------------------------------ a pod


def test_a_pods_torchrun_runs_its_workers_through_the_zygote_client_that_the_supervisor_provides():
    from relaunch.components.launchers.jobs import supervised

    args = ["--nnodes=2", "--rdzv-backend=c10d", "-m", "relaunch.components.train", "--config-json", "{}"]
    command = supervised(args)
    assert command[:4] == ["python", "-m", "relaunch.components.launchers.supervise", "torchrun"]
    assert command[4:] == [*args[:-4], "--no-python", "python", "-I", "-S", "/tmp/relaunch-zygote/client.py",
                           "-m", "relaunch.components.train", "--config-json", "{}"]
    assert supervised(args, warm=False)[4:] == args


def test_the_supervisors_zygote_serves_the_client_it_copied_and_ends_with_the_block(tmp_path, monkeypatch):
    from relaunch.components.core.runtime.zygote import for_command

    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    client = tmp_path / "client.py"
    command = ["torchrun", "--no-python", *client_command(sys.executable, client), *CHILD, "--config-json", "{}"]
    with for_command(command, ("tests.core.warm_child",), str(tmp_path)) as env:
        proc = subprocess.Popen([*client_command(sys.executable, client), *CHILD, "exit", "9"], cwd=ROOT,
                                env={**env, "WARM_PROBE": "pod"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        child = _report(proc)
        assert proc.wait(60) == 9 and child["warm"] and child["env"] == "pod", proc.stderr.read()
    assert not (tmp_path / "socket").exists()
    with for_command(["torchrun", "-m", "relaunch.components.train"], (), str(tmp_path / "unused")) as env:
        assert "RELAUNCH_ZYGOTE" not in env or env["RELAUNCH_ZYGOTE"] == os.environ.get("RELAUNCH_ZYGOTE")


@pytest.mark.parametrize("options", [["--nproc-per-node=2"], ["--standalone", "--nproc-per-node", "2"]])
def test_the_tests_start_a_torchruns_workers_through_the_zygote_client_whatever_the_form_of_its_options(options):
    from tests.warm_processes import warm_command

    torchrun = str(Path(sys.executable).parent / "torchrun")
    command = warm_command([torchrun, *options, "-m", "tests.core.fsdp_worker", "--steps", "2"])
    client = client_command()
    assert command == [*client, "-m", "torch.distributed.run", *options, "--no-python", *client, "-m",
                       "tests.core.fsdp_worker", "--steps", "2"]
