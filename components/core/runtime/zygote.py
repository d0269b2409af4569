"""The zygote: one pre-imported, single-threaded process per node that forks workers on request.

A restarted worker spends most of its start importing torch, torch.distributed, the task and the checkpoint
reader. The zygote imports them once, before any thread, CUDA context or NCCL communicator exists, and then
only waits on a unix socket; each worker command (:mod:`relaunch.components.core.runtime.zygote_client`, what
torchrun starts instead of ``python -m relaunch.components.train``) asks it to fork ``python -m MODULE ARGS``. The
fork gets the client's stdin/stdout/stderr, argv, environment and working directory, its own session,
default signal dispositions, no other descriptor of the zygote, and dies with the zygote (PDEATHSIG); it
runs MODULE as ``__main__`` and ends through the interpreter's own exit, as a cold process does. Its wait
status goes back to the client, which ends with it. See docs/warm-runtime.md for why this is safe and
what would break it.

    python -m relaunch.components.core.runtime.zygote serve --socket PATH [--preload MODULE ...]   # one node's zygote
    python -m relaunch.components.core.runtime.zygote run [--preload MODULE ...] -- COMMAND ...    # a pod's command

``run`` starts the zygote, waits until it listens, runs COMMAND with ``RELAUNCH_ZYGOTE`` set and the
client at :data:`CLIENT_PATH`, forwards SIGTERM/SIGINT/SIGUSR1 to it, stops the zygote when COMMAND ended,
and exits with COMMAND's status. A pod does the same inside its supervisor (:func:`for_command`, called by
:mod:`relaunch.components.launchers.supervise`), whose torchrun runs ``--no-python python -I -S CLIENT_PATH -m
relaunch.components.train ...`` (:func:`relaunch.components.launchers.jobs.supervised`).

Before each fork the zygote checks it is still single-threaded (Python threads and OS threads): if an
import started a thread it refuses, and every worker starts cold (the client says so).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import dis
import gc
import importlib
import importlib.util
import io
import json
import os
import runpy
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import types
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .warm import die_with_parent
from .zygote_client import HEADER, ZYGOTE_ENV

PRELOAD = ("torch", "torch.distributed", "torch.distributed.run", "torch.distributed.checkpoint",
           "torch.distributed.checkpoint.state_dict", "numpy.ma", "xxhash", "torch.utils.serialization",
           # the data loader's worker processes and their queues (components/core/data/loader.py)
           "multiprocessing.heap", "multiprocessing.popen_fork", "multiprocessing.queues", "multiprocessing.sharedctypes")
"""What every worker imports before its first step besides our own modules (measured: the modules new in a
forked worker at its ``first-step`` event), MLflow excepted, which loads after it. Our modules are not named
here: the starter names the worker's module and its task (``--preload``), and :func:`preload_modules` adds
the modules of ours that those import inside functions or name in a table (:func:`named_modules`)."""
OURS = __name__.split(".")[0] + "."
"""The prefix of our modules' names (``relaunch.``)."""
ZYGOTE_DIR = "/tmp/relaunch-zygote"
"""Where :func:`run` puts the socket and a copy of the client in a pod (one training container per pod)."""
CLIENT_PATH = f"{ZYGOTE_DIR}/client.py"
CLIENT_SOURCE = Path(__file__).with_name("zygote_client.py")
SINGLE_THREAD_ENV = {"OPENBLAS_NUM_THREADS": "1", "JE_ARROW_MALLOC_CONF": "background_thread:false"}
"""Threads an import starts unless told not to, which a process that forks must not have: numpy's OpenBLAS
pool, and pyarrow's jemalloc background thread (MLflow imports pyarrow)."""
MODULE = "relaunch.components.core.runtime.zygote"


def _kill_group(pid: int) -> None:
    """SIGKILL a child and the processes it started: each child leads its own session, so its process
    group holds what it started (an in-place agent's worker clients) unless they left it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def client_command(python: str = sys.executable, client: str | os.PathLike = CLIENT_SOURCE) -> list[str]:
    """The worker command prefix torchrun runs with ``--no-python``: ``python -I -S client``."""
    return [python, "-I", "-S", str(client)]


def os_threads() -> int:
    """Threads of this process as the kernel counts them (OpenMP and BLAS pools included)."""
    return len(os.listdir("/proc/self/task"))


def single_threaded() -> str | None:
    """None when this process has exactly one thread and no CUDA context, else what is wrong."""
    if threading.active_count() != 1 or os_threads() != 1:
        names = [t.name for t in threading.enumerate()]
        return f"the zygote has {os_threads()} OS threads (Python threads: {names}); it forks only single-threaded"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():  # a flag: asking makes no CUDA call
        return "the zygote initialised CUDA, whose context does not survive fork; it forks only before CUDA"
    return None


def preload_modules(names: tuple[str, ...] | list[str]) -> None:
    """Import ``names`` and every module of ours they reach (:func:`named_modules`, to the end; one that fails
    is skipped: the worker then imports, or fails on, it itself, as cold), then :func:`warm_up`, then freeze
    what was imported out of the garbage collector's reach, so that the forks never scan, and so never copy,
    those pages."""
    gc.disable()  # imports allocate millions of objects that live as long as the process: ~20% faster
    try:
        todo, seen = list(names), set()
        while todo:
            name = todo.pop(0)
            if name in seen:
                continue
            seen.add(name)
            try:
                module = importlib.import_module(name)
            except Exception as err:  # noqa: BLE001
                if name in names:
                    print(f"relaunch zygote: could not preload {name}: {type(err).__name__}: {err}", file=sys.stderr,
                          flush=True)
                continue
            if name.startswith(OURS):
                todo += sorted(named_modules(module) - seen)
            todo += sorted(m for m in list(sys.modules) if m.startswith(OURS) and m not in seen)
        warm_up()
    finally:
        gc.enable()
    gc.freeze()


def named_modules(module: types.ModuleType) -> set[str]:
    """The modules of ours that ``module`` imports inside its functions (the names their compiled code
    imports) or names in a string it keeps (a ``"module:attribute"`` table): what it would import later.
    Read from the loaded code, not its source: no parsing."""
    found: set[str] = set()

    def code(c: types.CodeType) -> None:
        loaded: list[object] = []  # the constants loaded since the last other instruction: an import's level, fromlist
        for instruction in dis.get_instructions(c):
            if instruction.opname == "IMPORT_NAME" and len(loaded) >= 2:
                found.update(_imported(instruction.argval, loaded[-2], loaded[-1], module.__package__ or ""))
            loaded = [*loaded, instruction.argval] if instruction.opname == "LOAD_CONST" else []
        for const in c.co_consts:
            if isinstance(const, types.CodeType):
                code(const)

    def value(v: object, depth: int = 0) -> None:
        if isinstance(v, str):
            if v.startswith(OURS):
                found.add(v.partition(":")[0])
        elif isinstance(v, types.FunctionType):
            code(v.__code__)
        elif isinstance(v, type) and v.__module__ == module.__name__ and depth == 0:
            for member in vars(v).values():
                value(getattr(member, "__func__", member), depth + 1)
        elif isinstance(v, (tuple, list, frozenset, set)) and depth == 0:
            for item in v:
                value(item, depth + 1)
        elif isinstance(v, dict) and depth == 0:
            for item in (*v.keys(), *v.values()):
                value(item, depth + 1)

    for v in list(vars(module).values()):
        value(v)
    return {name for name in found if _is_module(name)}


def _imported(name: str, level: object, fromlist: object, package: str) -> set[str]:
    """The modules of ours an ``IMPORT_NAME name`` (after ``level`` and ``fromlist``) of code in ``package``
    imports: the module, absolute or relative, and each name of its fromlist (the modules among them)."""
    if not isinstance(level, int):
        return set()
    try:
        base = importlib.util.resolve_name("." * level + name, package) if level else name
    except (ImportError, ValueError):
        return set()
    if not base.startswith(OURS):
        return set()
    items = fromlist if isinstance(fromlist, tuple) else ()
    return {base, *(f"{base}.{item}" for item in items if isinstance(item, str) and item.isidentifier())}


def _is_module(name: str) -> bool:
    """``name`` is a module (``package.function``, which a ``from package import function`` also names, is not)."""
    parent, _, child = name.rpartition(".")
    package = sys.modules.get(parent)
    if package is not None and not isinstance(getattr(package, child, None), (types.ModuleType, type(None))):
        return False
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def warm_up() -> None:
    """What a worker's first optimiser would do lazily, done once before the forks: every
    ``torch.optim.Optimizer`` imports ``torch._dynamo`` on its first ``add_param_group`` (1.4-2.4 s on the
    busy 2-core machine, most of a warm restart). A throwaway optimiser over an empty CPU tensor does it
    through public API; it runs no kernel (no OpenMP pool) and touches no CUDA."""
    torch = sys.modules.get("torch")
    if torch is None or "torch.optim" not in sys.modules:
        return
    param = torch.nn.Parameter(torch.empty(0))
    optimizer = torch.optim.SGD([param], lr=0.0)
    optimizer.step()  # the step's wrapper caches its dynamo-disabled twin too
    del optimizer, param


@dataclass
class Job:
    """What a forked child is to become."""

    argv: list[str]
    env: dict[str, str]
    cwd: str
    parent: int = 0
    """The zygote's pid: the child dies with it."""


def _receive(conn: socket.socket) -> tuple[dict, list[int]] | None:
    header, fds, _, _ = socket.recv_fds(conn, HEADER.size, 3)
    if len(header) < HEADER.size or len(fds) != 3:
        for fd in fds:
            os.close(fd)
        return None
    (size,) = HEADER.unpack(header)
    body = bytearray()
    while len(body) < size:
        chunk = conn.recv(min(1 << 20, size - len(body)))
        if not chunk:
            for fd in fds:
                os.close(fd)
            return None
        body += chunk
    return json.loads(body), fds


def _send(conn: socket.socket, message: dict) -> None:
    """One message to a client; one that left early is not an error of the zygote."""
    with contextlib.suppress(OSError):
        conn.sendall(json.dumps(message).encode() + b"\n")


def _refusal(request: dict) -> str | None:
    argv = request.get("argv") or []
    if len(argv) < 2 or argv[0] != "-m":
        return f"the zygote runs only '-m MODULE ...', not {argv[:2]}"
    if request.get("env", {}).get("PYTHONPATH", "") != os.environ.get("PYTHONPATH", ""):
        return "the worker's PYTHONPATH differs from the zygote's"
    return single_threaded()


class ForkServer:
    """The zygote's side of the client protocol, for any single-threaded select loop: the zygote's own
    (:func:`serve`) and the warm step server's (:mod:`relaunch.pipelines.local.warm_steps`), which answers the
    clients of a warm local run with forks of itself."""

    def __init__(self, listener: socket.socket, others: Callable[[], list[socket.socket]] = list):
        """``others``: the loop's own sockets, which a forked child must drop along with ours."""
        self.listener, self._others = listener, others
        self.running: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (pid, client connection)
        self.watching: dict[socket.socket, int] = {}  # client connection -> pidfd, while its client is there

    def selectable(self) -> list:
        """What the loop should select on for this server."""
        return [self.listener, *self.running, *self.watching]

    def handle(self, item) -> Job | None:
        """``item`` (one of :meth:`selectable`) is ready: act on it. Returns a :class:`Job` only in a
        freshly forked child, which must then :func:`become_worker`."""
        if item is self.listener:
            return self._accept()
        if isinstance(item, socket.socket):
            # the client ended (it never sends after its request): its worker must not outlive it
            pidfd = self.watching.pop(item)
            _kill_group(self.running[pidfd][0])
            return None
        pid, conn = self.running.pop(item)  # a child ended
        self.watching.pop(conn, None)
        os.close(item)
        try:
            _, status = os.waitpid(pid, 0)
        except ChildProcessError as err:  # never reported as a success
            _send(conn, {"lost": f"cannot read worker {pid}'s exit status: {err}"})
        else:
            _send(conn, {"status": status})
        conn.close()
        return None

    def _accept(self) -> Job | None:
        conn, _ = self.listener.accept()
        conn.settimeout(30)
        try:
            received = _receive(conn)
        except (OSError, ValueError):
            received = None
        if received is None:
            conn.close()
            return None
        request, fds = received
        refused = _refusal(request)
        if refused is None:
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            parent = os.getpid()
            pid = os.fork()
            if pid == 0:
                _become(fds, [self.listener, conn, *(c for _, c in self.running.values()), *self._others()])
                return Job(request["argv"], request["env"], request["cwd"], parent)
        for fd in fds:
            os.close(fd)
        if refused is not None:
            _send(conn, {"refused": refused})
            conn.close()
            return None
        _send(conn, {"pid": pid})
        pidfd = os.pidfd_open(pid)
        self.running[pidfd] = (pid, conn)
        self.watching[conn] = pidfd
        return None

    def stop(self) -> None:
        """Kill the children still running and report them."""
        for pidfd, (pid, conn) in self.running.items():
            _kill_group(pid)
            with contextlib.suppress(ChildProcessError):
                _, status = os.waitpid(pid, 0)
                _send(conn, {"status": status})
            conn.close()
            os.close(pidfd)
        self.running.clear()
        self.watching.clear()


def listen(socket_path: str) -> socket.socket:
    """A unix socket listening at ``socket_path`` (replacing a stale one)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(socket_path)
    listener.bind(socket_path)
    listener.listen(64)
    return listener


def serve(listener: socket.socket, lifeline: int) -> Job | None:
    """Fork a child per request until ``lifeline`` reads end-of-file (its starter ended), then kill the
    children still running and return None. In a child, returns the :class:`Job` it is to run."""
    server = ForkServer(listener)
    while True:
        ready, _, _ = select.select([lifeline, *server.selectable()], [], [])
        for item in ready:
            if isinstance(item, int) and item == lifeline:
                if not os.read(lifeline, 1):
                    server.stop()
                    return None
                continue
            job = server.handle(item)
            if job is not None:
                return job


def _become(fds: list[int], sockets: list[socket.socket]) -> None:
    """In the fresh child: the client's streams as 0, 1, 2 and no other descriptor of the zygote."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for sock in sockets:
        sock.detach()  # the descriptors are closed below; the objects must not close them again
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))


def become_worker(job: Job) -> None:
    """Turn this forked child into ``python -u -m MODULE ARGS`` and run it; the interpreter then exits as
    a cold one does (atexit handlers, non-daemon threads, uncaught exceptions, SystemExit, SIGINT)."""
    os.setsid()
    die_with_parent(job.parent or os.getppid())
    signal.set_wakeup_fd(-1)
    for sig in signal.valid_signals():
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            with contextlib.suppress(OSError, ValueError):
                signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # what the interpreter itself sets at start-up
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    os.environ.clear()
    os.environ.update(job.env)
    tempfile.tempdir = None  # found again from the job's TMPDIR, not the zygote's
    os.chdir(job.cwd)
    sys.path[0] = job.cwd  # ``python -m`` puts the working directory first
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
    sys.stdout = sys.__stdout__ = _text_stream(1)
    sys.stderr = sys.__stderr__ = _text_stream(2)
    if job.env.get("OMP_NUM_THREADS", "").isdigit() and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(job.env["OMP_NUM_THREADS"]))
    module = job.argv[1]
    sys.argv = [module, *job.argv[2:]]
    # runpy notes that the zygote imported the module before it runs as __main__: expected here
    warnings.filterwarnings("ignore", message=".*found in sys.modules after import of package", category=RuntimeWarning)
    atexit.register(_end_by_sigint)  # after the module's own handlers, before those of the preload
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except KeyboardInterrupt:
        global _interrupted
        _interrupted = True
        raise


_interrupted = False


def _end_by_sigint() -> None:
    """An uncaught KeyboardInterrupt ends an interpreter by SIGINT once its atexit handlers ran; an atexit
    handler of torch._dynamo (which the preload's warm-up imports) makes it forget and exit 1 instead (a
    cold process that imported torch._dynamo does the same). Registered before the worker's module runs,
    this runs after the module's handlers and before torch's, and ends the worker as Python documents."""
    if _interrupted:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)


def _text_stream(fd: int) -> io.TextIOWrapper:
    """An unbuffered text stream, as ``python -u`` gives (torchrun starts its workers with ``-u``)."""
    return io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding="utf-8", errors="backslashreplace",
                            line_buffering=True, write_through=True)


def _serve_main(socket_path: str, modules: list[str], lifeline: int) -> None:
    listener = listen(socket_path)  # before the imports: a client that connects early waits in the backlog, not cold
    for sig in (signal.SIGINT, signal.SIGTERM):  # the starter ends the zygote (lifeline); its workers get the signals
        signal.signal(sig, signal.SIG_IGN)
    os.environ.setdefault("MPLBACKEND", "Agg")
    preload_modules(modules)
    problem = single_threaded()
    if problem:
        print(f"relaunch zygote: {problem}: every worker will start cold", file=sys.stderr, flush=True)
    job = serve(listener, lifeline)
    if job is None:
        listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(socket_path)
        sys.stdout.flush()
        os._exit(0)  # nothing to tear down; freeing torch module by module takes seconds
    become_worker(job)


class Zygote:
    """A zygote this process started: :attr:`env` points worker clients at it; :meth:`close` ends it."""

    def __init__(self, socket_path: str, preload: tuple[str, ...] = (), *, log=None, ready_timeout: float = 30.0,
                 env: dict[str, str] | None = None, cwd: str | None = None):
        """Start ``python -m relaunch.components.core.runtime.zygote serve`` and wait until it listens.

        Args:
            socket_path: where it listens (a path short enough for a unix socket).
            preload: modules to import besides :data:`PRELOAD` (the task).
            log: a file for its own output (None: this process's).
            env, cwd: its environment (default: this process's) and directory; a worker whose
                ``PYTHONPATH`` differs from the zygote's is refused and starts cold.
        """
        self.socket_path = socket_path
        read_end, self._lifeline = os.pipe()
        env = {**(os.environ if env is None else env), **SINGLE_THREAD_ENV}
        self.process = subprocess.Popen(
            [sys.executable, "-m", MODULE, "serve", "--socket", socket_path, "--lifeline", str(read_end),
             *(arg for name in preload for arg in ("--preload", name))],
            pass_fds=(read_end,), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT if log else None,
            env=env, cwd=cwd, start_new_session=True)
        os.close(read_end)
        deadline = time.monotonic() + ready_timeout
        while not os.path.exists(socket_path) and self.process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)

    @property
    def env(self) -> dict[str, str]:
        return {ZYGOTE_ENV: self.socket_path}

    def close(self) -> None:
        """End the zygote (it kills the workers still running) and wait for it; idempotent."""
        if self._lifeline is not None:
            os.close(self._lifeline)
            self._lifeline = None
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@contextlib.contextmanager
def for_command(command: list[str], preload: tuple[str, ...] = (), directory: str = ZYGOTE_DIR):
    """The environment to run ``command`` in: when its workers are the zygote client at :data:`CLIENT_PATH`
    (what :func:`relaunch.components.launchers.jobs.supervised` renders for a pod), a zygote in ``directory`` with
    the client beside it, for as long as the block runs; otherwise this process's environment."""
    if CLIENT_PATH.replace(ZYGOTE_DIR, directory) not in command:
        yield dict(os.environ)
        return
    os.makedirs(directory, exist_ok=True)
    shutil.copyfile(CLIENT_SOURCE, os.path.join(directory, "client.py"))
    zygote = Zygote(os.path.join(directory, "socket"), (*worker_module(command), *preload))
    try:
        yield {**os.environ, **zygote.env}
    finally:
        zygote.close()


def worker_module(command: list[str]) -> tuple[str, ...]:
    """``(MODULE,)`` of a command whose workers are the zygote client (``... client.py -m MODULE ...``): the
    module the zygote preloads for them; ``()`` for any other command."""
    for i, arg in enumerate(command[:-2]):
        if arg.endswith("client.py") and command[i + 1] == "-m":
            return (command[i + 2],)
    return ()


def run(command: list[str], preload: tuple[str, ...], directory: str = ZYGOTE_DIR) -> int:
    """Start the zygote in ``directory`` with the client beside it, run ``command`` with the zygote's
    environment, forwarding SIGTERM/SIGINT/SIGUSR1; returns ``command``'s exit code (128 + the signal
    when it was killed by one)."""
    os.makedirs(directory, exist_ok=True)
    shutil.copyfile(CLIENT_SOURCE, os.path.join(directory, "client.py"))
    zygote = Zygote(os.path.join(directory, "socket"), (*worker_module(command), *preload))
    try:
        child = subprocess.Popen(command, env={**os.environ, **zygote.env})
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            signal.signal(sig, lambda signum, _frame: child.send_signal(signum))
        code = child.wait()
    finally:
        zygote.close()
    return code if code >= 0 else 128 - code


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m relaunch.components.core.runtime.zygote", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    serve_parser = sub.add_parser("serve", help="be one node's zygote")
    serve_parser.add_argument("--socket", required=True)
    serve_parser.add_argument("--lifeline", type=int, required=True, help="a pipe whose end-of-file ends the zygote")
    run_parser = sub.add_parser("run", help="start a zygote, then run COMMAND with it (a pod's command)")
    run_parser.add_argument("--dir", default=ZYGOTE_DIR)
    for p in (serve_parser, run_parser):
        p.add_argument("--preload", action="append", default=[], metavar="MODULE")
    run_parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.mode == "serve":
        _serve_main(args.socket, [*PRELOAD, *args.preload], args.lifeline)
        return
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("run needs a COMMAND after --")
    sys.exit(run(command, tuple(args.preload), args.dir))


if __name__ == "__main__":
    main()
