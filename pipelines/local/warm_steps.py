"""The warm servers of ``relaunch run``: processes that import kfp's executor, MLflow with its SQL store,
(torch with DCP) and the steps once, then fork each kfp.local step from themselves instead of kfp.local
starting a fresh interpreter that imports them again (seconds per step on a small machine). A server
forks only while it is single-threaded (it refuses otherwise, and the step runs cold), ignores Ctrl-C
and SIGTERM (the steps get them; the server reaps them and reports how they ended, 130 for an
interrupted one), and when the run closes it, waits for the steps still running before it exits. If the
run dies, its guardian (:mod:`relaunch.pipelines.local.guardian`) kills the servers, and their children with them.

kfp.local still runs the pipeline: its orchestrator resolves the inputs, builds each task's command
and reads the outputs. :func:`relaunch.pipelines.local.kfp_fixes.install_local_fixes` routes the command of a
lightweight component (``sh -ec '<kfp script>' <source> --executor_input ... --function_to_execute f``)
to :meth:`WarmSteps.run`, which has a server fork a child that does what that script does: write the
source to a temporary file and run ``python -m kfp.dsl.executor_main`` on it, with the task's
environment, working directory and a pipe for its output. The exit status comes back over a socket.
A command it does not recognise, or a server that is gone, runs cold as kfp.local would run it.

Two servers start together, one per core, at the same priority: the *light* one imports what prepare,
locate, register and finalize need and is ready first; the *full* one adds torch, DCP and matplotlib
for the steps marked :attr:`relaunch.pipelines.spec.Step.uses_torch` (launch, evaluate). A step's child is warm
(:data:`relaunch.components.core.runtime.warm.forked`): the launch step then starts its torchrun agents and
workers through per-node zygotes (:mod:`relaunch.components.core.runtime.zygote`), never as forks of itself.
``relaunch run --cold`` starts no server: every process is a fresh interpreter, as on a cluster.

Shared servers (the test suite's): with :data:`SHARED_ENV` naming a directory where :func:`start_shared`
started a light and a full server, a run connects to those instead of starting its own (the imports are
then paid once per test session, not once per run). Each run is its own connection; each step is still a
fresh fork with the run's environment, working directory (first on ``sys.path``, as ``python -m`` puts
it) and output, and the torchrun workers are forks of the shared full server's zygote. A run whose
``PYTHONPATH`` differs from the servers', or that cannot connect, starts its own servers. The steps of
a run that closed its connection get :data:`STOP_GRACE_SECONDS`, then are killed. Shared steps are not
the run's descendants: a run that is interrupted or killed from outside must use its own servers.

    python -m relaunch.pipelines.local.warm_steps FD light|full|none ZYGOTE_SOCKET|- CLIENTS_SOCKET|- [MODULE ...]
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ..spec import KFP_STEPS, STEP_MODULES
from ...components.core.runtime.warm import SignalledByPid, fork_module
from ...components.core.runtime.zygote import (ForkServer, Job, SINGLE_THREAD_ENV, become_worker, listen,
                                               single_threaded, warm_up)
from ...components.core.runtime.zygote_client import ZYGOTE_ENV

LIGHT_IMPORTS = (
    "kfp.dsl.executor_main", "relaunch.pipelines.kfp_entry", *STEP_MODULES.values(),
    "mlflow", "mlflow.tracking", "mlflow.data", "mlflow.models",
    "mlflow.store.tracking.sqlalchemy_store", "mlflow.store.model_registry.sqlalchemy_store",
    "sqlalchemy.dialects.sqlite",
)
"""What every step imports (the step modules themselves import little: they import lazily)."""
TORCH_IMPORTS = (
    "relaunch.components.train", "torch", "torch.distributed.run", "torch.distributed.elastic.multiprocessing.subprocess_handler",
    "torch.distributed.checkpoint", "torch.distributed.checkpoint.state_dict", "torch.distributed.fsdp",
    "torch._dynamo.aot_compile", "torch._dynamo.polyfills.loader", "tabulate",
    "mlflow.system_metrics.system_metrics_monitor", "mlflow.pyfunc.loaders",
    "matplotlib", "matplotlib.pyplot", "matplotlib.backends.backend_agg",
)
"""What the torchrun agents, the workers and evaluate add (DCP's state-dict helpers import torch._dynamo).
An import that fails is skipped: the step then imports, or fails, as it would cold."""
SERVER_IMPORTS = {"light": LIGHT_IMPORTS, "full": (*TORCH_IMPORTS, *LIGHT_IMPORTS), "none": ()}
"""What each server imports ("none": nothing beyond this module, for the tests of the server itself)."""
STOP_GRACE_SECONDS = 25.0
"""Once the run closed a server, how long its steps still running get (the launch step stops its agents
in up to 20 s) before they are killed."""

SHARED_ENV = "RELAUNCH_WARM_SERVERS"
"""A directory holding the sockets of shared warm servers (:func:`start_shared`): ``relaunch run`` then
forks its steps from those (see the module's note)."""
_SHARED_SOCKETS = {"light": "light.sock", "full": "full.sock"}
_SHARED_ZYGOTE = "zygote.sock"
_SHARED_PYTHONPATH = "pythonpath"

_HEADER = struct.Struct("!Q")
_SCRIPT_MARKERS = ('"$program_path/ephemeral_component.py"', "kfp.dsl.executor_main", '"$@"')


def executor_call(full_command: list[str]) -> tuple[str, list[str]] | None:
    """``(component source, executor arguments)`` of a lightweight component's command, else None."""
    if len(full_command) < 4 or full_command[0] != "sh" or full_command[1] not in ("-c", "-ec"):
        return None
    script = full_command[2]
    if not all(marker in script for marker in _SCRIPT_MARKERS) or "pip" in script:
        return None
    return full_command[3], list(full_command[4:])


def server_for(executor_args: list[str]) -> str:
    """"full" for a step that uses torch (or an unknown one), else "light"."""
    function = executor_args[executor_args.index("--function_to_execute") + 1] \
        if "--function_to_execute" in executor_args[:-1] else ""
    step = KFP_STEPS.get(function.replace("_", "-"))
    return "light" if step is not None and not step.uses_torch else "full"


def supported() -> bool:
    """Warm servers need Linux: ``fork`` without ``exec`` is unsafe on macOS (its system libraries), and
    the server waits for its children with pidfds."""
    return sys.platform == "linux" and hasattr(os, "pidfd_open")


class RemoteProcess(SignalledByPid):
    """A child a warm server forked on our behalf: the ``subprocess.Popen`` surface (``pid``,
    ``returncode``, ``poll``, ``wait``, ``send_signal``, ``terminate``, ``kill``). The server is its
    parent and reaps it; its exit status comes back over ``status``."""

    def __init__(self, status: socket.socket, args: list[str]):
        self._status, self.args = status, args
        self._buffer = b""
        self.pid = 0
        self.returncode: int | None = None

    def _line(self, timeout: float | None) -> bytes | None:
        """The next message; None when ``timeout`` passed first, b"" when the server is gone."""
        while b"\n" not in self._buffer:
            ready, _, _ = select.select([self._status], [], [], timeout)
            if not ready:
                return None
            chunk = self._status.recv(4096)
            if not chunk:
                return b""
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line

    def _ended(self, line: bytes) -> None:
        message = json.loads(line) if line else {}
        if "exit" in message:
            self.returncode = int(message["exit"])
        else:  # the server died (its children die with it) or lost the status: killed, never a success
            self.returncode = -signal.SIGKILL
            print(f"relaunch: warm step {self.pid}: {message.get('lost', 'its server ended')}", file=sys.stderr, flush=True)
        self._status.close()

    def poll(self) -> int | None:
        if self.returncode is None:
            line = self._line(0)
            if line is not None:
                self._ended(line)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            line = self._line(timeout)
            if line is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._ended(line)
        return self.returncode


class WarmServer:
    """One server process (``imports``: "light", "full" or "none") and the requests to it; with
    ``zygote_socket`` it also answers zygote clients there (:mod:`relaunch.components.core.runtime.zygote`)."""

    def __init__(self, imports: str, log, extra_imports: tuple[str, ...] = (), cwd: str | None = None,
                 zygote_socket: str | None = None, clients_socket: str | None = None, env: dict[str, str] | None = None):
        self.control, server_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._lock = threading.Lock()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "relaunch.pipelines.local.warm_steps", str(server_end.fileno()), imports,
             zygote_socket or "-", clients_socket or "-", *extra_imports],
            pass_fds=(server_end.fileno(),), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=cwd,
            env={**(os.environ if env is None else env), **SINGLE_THREAD_ENV})
        server_end.close()

    def start(self, request: dict, fds: list[int]) -> RemoteProcess | None:
        """Have the server fork a child for ``request``, passing it ``fds`` (its output); None when
        the server is gone (the caller then starts the process cold)."""
        if not self.alive():
            return None
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        body = json.dumps(request).encode()
        try:
            with self._lock:
                socket.send_fds(self.control, [_HEADER.pack(len(body))], [theirs.fileno(), *fds])
                self.control.sendall(body)
        except OSError:
            mine.close()
            return None
        finally:
            theirs.close()
        child = RemoteProcess(mine, request.get("argv") or [request["kind"]])
        forked = child._line(None)
        answer = json.loads(forked) if forked else {}
        if "pid" not in answer:  # the server ended before it forked, or refused
            if answer.get("refused"):
                print(f"relaunch: warm server refused ({answer['refused']}); running the step cold", file=sys.stderr)
            mine.close()
            return None
        child.pid = int(answer["pid"])
        return child

    def alive(self) -> bool:
        return self.process.poll() is None

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.control.close()
        try:
            self.process.wait(STOP_GRACE_SECONDS + 10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class SharedServer(WarmServer):
    """A connection to a shared server (:func:`start_shared`): the same requests; closing it leaves the
    server running (the steps of this connection still running get :data:`STOP_GRACE_SECONDS`)."""

    def __init__(self, socket_path: str):  # noqa: D107 - no process of our own
        self.control = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._lock = threading.Lock()
        try:
            self.control.connect(socket_path)
        except OSError:
            self.control.close()
            raise

    def alive(self) -> bool:
        return self.control.fileno() >= 0

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.control.close()


def shared_servers(env: dict[str, str] | None = None) -> tuple[dict[str, WarmServer], str] | None:
    """``({"light": ..., "full": ...}, zygote socket)`` connected to the shared servers that
    :data:`SHARED_ENV` names in ``env`` (this process's environment by default), or None: none named,
    one gone, or their ``PYTHONPATH`` is not ours (a fork keeps its server's ``sys.path``)."""
    env = os.environ if env is None else env
    folder = env.get(SHARED_ENV)
    if not folder:
        return None
    try:
        if Path(folder, _SHARED_PYTHONPATH).read_text() != env.get("PYTHONPATH", ""):
            return None
    except OSError:
        return None
    servers: dict[str, WarmServer] = {}
    try:
        for kind, name in _SHARED_SOCKETS.items():
            servers[kind] = SharedServer(os.path.join(folder, name))
    except OSError:
        for server in servers.values():
            server.close()
        return None
    return servers, os.path.join(folder, _SHARED_ZYGOTE)


def start_shared(folder: str, log, imports: str | None = None, extra_imports: tuple[str, ...] = (),
                 cwd: str | None = None, env: dict[str, str] | None = None) -> list[WarmServer]:
    """Start a light and a full server that any number of runs share through :data:`SHARED_ENV` =
    ``folder`` (their sockets are made there), in ``cwd`` with ``env`` (this process's by default); close
    them with :meth:`WarmServer.close`. ``imports`` ("none" for the tests of the servers) replaces what
    each imports."""
    env = dict(os.environ if env is None else env)
    Path(folder, _SHARED_PYTHONPATH).write_text(env.get("PYTHONPATH", ""))
    servers = [WarmServer(imports or kind, log, extra_imports, cwd=cwd, env=env, clients_socket=os.path.join(folder, name),
                          zygote_socket=os.path.join(folder, _SHARED_ZYGOTE) if kind == "full" else None)
               for kind, name in _SHARED_SOCKETS.items()]
    for server, name in zip(servers, _SHARED_SOCKETS.values()):  # listening (before its imports) once it returns
        while server.alive():
            with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                probe.connect(os.path.join(folder, name))
                break
            time.sleep(0.05)
    return servers


class WarmSteps:
    """The client side, in ``relaunch run``: starts the servers, runs steps through them, stops them.
    The full server is also the run's zygote: the launch step's torchrun workers are forks of it."""

    def __init__(self, *, log_path: Path, extra_imports: tuple[str, ...] = (), share: bool = True):
        """``share``: connect to the shared servers :data:`SHARED_ENV` names, when there are usable ones."""
        self._log_path = log_path
        self._dir = None
        shared = shared_servers() if share else None
        if shared is not None:
            self._servers, self.zygote_socket = shared
            self.shared = True
            return
        self.shared = False
        self._dir = tempfile.TemporaryDirectory(prefix="relaunch-warm-")
        self.zygote_socket = os.path.join(self._dir.name, "zygote.sock")
        with open(log_path, "a") as log:
            self._servers = {kind: WarmServer(kind, log, extra_imports,
                                              zygote_socket=self.zygote_socket if kind == "full" else None)
                             for kind in ("light", "full")}

    def run(self, full_command: list[str], env_vars: dict[str, str] | None) -> int | None:
        """Run one task's command in a fork of a server, echoing its output; its exit code, or None
        when it cannot (the caller runs it cold)."""
        call = executor_call(full_command)
        if call is None:
            return None
        read_end, write_end = os.pipe()
        try:
            step = self._servers[server_for(call[1])].start(
                {"kind": "kfp", "source": call[0], "args": call[1], "cwd": os.getcwd(),
                 "env": {**os.environ, **(env_vars or {}), ZYGOTE_ENV: self.zygote_socket}}, [write_end])
        finally:
            os.close(write_end)
        if step is None:
            os.close(read_end)
            return None
        relay_output(open(read_end, encoding="utf-8", errors="replace"), self._log_path)
        print("\n")
        return step.wait()

    @property
    def pids(self) -> list[int]:
        """The servers' pids: the run stops their steps, never them (they end when closed); none when shared
        (they are not the run's children)."""
        return [] if self.shared else [server.process.pid for server in self._servers.values()]

    def close(self) -> None:
        for server in self._servers.values():
            server.close()
        if self._dir is not None:
            self._dir.cleanup()


def relay_output(output, log_path: Path | None) -> None:
    """Print each line of a step's ``output`` (a text stream) until it ends, then close it. When the run
    is interrupted meanwhile, the step is stopping itself (its training commits a preemption checkpoint
    and reports it): a closed pipe would break its output midway (EPIPE), so a thread copies the rest
    to the run's log (``log_path``; nowhere when None) while the exception goes on."""
    try:
        for line in output:
            print(line, end="")
    except BaseException:
        threading.Thread(target=_drain, args=(output, log_path), daemon=True, name="relaunch-drain").start()
        raise
    output.close()


def _drain(output, log_path: Path | None) -> None:
    with output, open(log_path or os.devnull, "a") as log:
        for line in output:
            log.write(line)
            log.flush()


def _receive(control: socket.socket) -> tuple[dict, list[int]] | None:
    header, fds, _, _ = socket.recv_fds(control, _HEADER.size, 3)
    if len(header) < _HEADER.size:
        for fd in fds:
            os.close(fd)
        return None
    (size,) = _HEADER.unpack(header)
    body = bytearray()
    while len(body) < size:
        chunk = control.recv(min(1 << 20, size - len(body)))
        if not chunk:
            return None
        body += chunk
    return json.loads(body), fds


def _send(status: socket.socket, message: dict) -> None:
    """One message to a requester; one that left early must not take the server down."""
    with contextlib.suppress(OSError):
        status.sendall(json.dumps(message).encode() + b"\n")


def _reap(pid: int, status: socket.socket, temp_dir: str | None) -> None:
    """Wait for a child and report its exit code (never a success it cannot read)."""
    try:
        _, wait_status = os.waitpid(pid, 0)
    except ChildProcessError as err:
        _send(status, {"lost": f"cannot read the exit status of {pid}: {err}"})
    else:
        _send(status, {"exit": os.waitstatus_to_exitcode(wait_status)})
    status.close()
    if temp_dir:
        shutil.rmtree(temp_dir, ignore_errors=True)


def serve(control: socket.socket, imports: tuple[str, ...], zygote_socket: str | None = None,
          clients_socket: str | None = None) -> Job | None:
    """Import ``imports``, then fork a child per request until the control socket closes; then wait for
    the children still running (:data:`STOP_GRACE_SECONDS`, then kill them) and report how each ended.
    With ``zygote_socket``, also fork a worker per zygote client there; in such a fork, returns its
    :class:`~relaunch.components.core.runtime.zygote.Job`. With ``clients_socket``, also take the requests
    of any number of shared clients connecting there (:class:`SharedServer`); the children of one that
    left get :data:`STOP_GRACE_SECONDS`, then are killed."""
    running: dict[int, tuple[int, socket.socket, str | None]] = {}  # pidfd -> (pid, status socket, temp dir)
    requested_on: dict[int, socket.socket] = {}  # pidfd -> the shared client's connection that asked for it
    left: dict[int, float] = {}  # pidfd -> when its shared client left
    clients: list[socket.socket] = []
    listener = listen(clients_socket) if clients_socket else None
    workers = None
    if zygote_socket:  # listening before the imports: an early client waits in the backlog
        workers = ForkServer(listen(zygote_socket), lambda: [control, *([listener] if listener else []), *clients,
                                                             *(sock for _, sock, _ in running.values())])
    os.environ.setdefault("MPLBACKEND", "Agg")
    gc.disable()  # imports allocate millions of objects that live as long as the process: ~20% faster
    for name in imports:
        with contextlib.suppress(Exception):
            importlib.import_module(name)
    if zygote_socket:  # the full server: the steps that train, evaluate and register
        warm_up()  # what the workers' first optimiser would import
        with contextlib.suppress(Exception):
            from ...components.core.packaging.model import prepare_requirement_checks

            prepare_requirement_checks()  # what each fork's first saved model would compute
    gc.enable()
    gc.freeze()  # the forks never scan (and so never copy) what was imported
    closing_since: float | None = None
    while running or (workers and workers.running) or closing_since is None:
        timeout = None if closing_since is None else max(0.0, closing_since + STOP_GRACE_SECONDS - time.monotonic())
        if left:
            grace = max(0.0, min(left.values()) + STOP_GRACE_SECONDS - time.monotonic())
            timeout = grace if timeout is None else min(timeout, grace)
        listening = [control, *([listener] if listener else []), *clients] if closing_since is None else []
        watched = [*listening, *running, *(workers.selectable() if workers else [])]
        ready, _, _ = select.select(watched, [], [], timeout)
        for pidfd in [fd for fd, since in left.items() if time.monotonic() >= since + STOP_GRACE_SECONDS]:
            left.pop(pidfd)
            with contextlib.suppress(ProcessLookupError):  # its client left and its grace is over
                os.kill(running[pidfd][0], signal.SIGKILL)
        if not ready and closing_since is not None and time.monotonic() >= closing_since + STOP_GRACE_SECONDS:
            for pid, _, _ in running.values():  # the grace period is over
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if workers:
                workers.stop()
            closing_since = -STOP_GRACE_SECONDS  # wait for them to die, without a further timeout
            continue
        for fd in ready:
            if fd is control or fd in clients:
                received = _receive(fd)
                if received is None and fd is control:
                    closing_since = time.monotonic()
                elif received is None:  # a shared client left: its steps still running get their grace
                    clients.remove(fd)
                    fd.close()
                    left.update((pidfd, time.monotonic()) for pidfd, conn in requested_on.items() if conn is fd)
                else:
                    request, (status_fd, *output_fds) = received
                    status = socket.socket(fileno=status_fd)
                    refused = single_threaded()
                    if fd is not control and request.get("env", {}).get("PYTHONPATH", "") != os.environ.get("PYTHONPATH", ""):
                        refused = "the step's PYTHONPATH differs from the shared server's"
                    if refused:
                        _send(status, {"refused": refused})
                        status.close()
                        for output_fd in output_fds:
                            os.close(output_fd)
                        continue
                    pid, temp_dir = _fork(request, output_fds)
                    for output_fd in output_fds:
                        os.close(output_fd)
                    _send(status, {"pid": pid})
                    pidfd = os.pidfd_open(pid)
                    running[pidfd] = (pid, status, temp_dir)
                    if fd is not control:
                        requested_on[pidfd] = fd
            elif fd is listener:
                clients.append(listener.accept()[0])
            elif isinstance(fd, int) and fd in running:
                pid, status, temp_dir = running.pop(fd)
                requested_on.pop(fd, None)
                left.pop(fd, None)
                os.close(fd)
                _reap(pid, status, temp_dir)
            else:
                job = workers.handle(fd)
                if job is not None:
                    return job
    for sock in (listener, workers.listener if workers else None):
        if sock is not None:
            sock.close()
    for path in (clients_socket, zygote_socket):
        if path:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    return None


def _fork(request: dict, output_fds: list[int]) -> tuple[int, str | None]:
    """Fork the child ``request`` asks for: its pid, and a directory to remove when it has ended."""
    if request["kind"] == "kfp":  # what kfp's lightweight-component script does, in a fork
        try:  # in the run's TMPDIR, as a cold step's (a shared server's own may be another)
            source_dir = tempfile.mkdtemp(dir=request["env"].get("TMPDIR") or None)
        except OSError:  # not a usable folder: where Python falls back to
            source_dir = tempfile.mkdtemp()
        path = Path(source_dir, "ephemeral_component.py")
        path.write_text(request["source"])
        return fork_module("kfp.dsl.executor_main", ["--component_module_path", str(path), *request["args"]],
                           env={**request["env"], "_KFP_RUNTIME": "true"}, stdout_fd=output_fds[0],
                           stderr_fd=output_fds[0], cwd=request["cwd"]), source_dir
    return fork_module(request["module"], request["argv"], env=request["env"], stdout_fd=output_fds[0],
                       stderr_fd=output_fds[-1], cwd=request["cwd"], new_session=request.get("new_session", False)), None


def main(argv: list[str]) -> None:
    control = socket.socket(fileno=int(argv[0]))
    # Ctrl-C of the run reaches the whole process group, and the run sends its processes SIGTERM: the
    # steps and workers stop (a preemption checkpoint), the server reaps and reports them. The server
    # itself ends when its control socket closes; dying first would SIGKILL its children (PDEATHSIG)
    # before they commit. If the run dies, its guardian ends the server (pipelines/local/guardian.py).
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    job = serve(control, (*SERVER_IMPORTS[argv[1]], *argv[4:]), None if argv[2] == "-" else argv[2],
                None if argv[3] == "-" else argv[3])
    if job is not None:  # a zygote client's worker, forked: it ends as a cold interpreter does

        become_worker(job)
        return
    sys.stdout.flush()
    os._exit(0)  # nothing to tear down: freeing torch and MLflow module by module takes seconds


if __name__ == "__main__":
    main(sys.argv[1:])
