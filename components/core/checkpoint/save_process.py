"""The CPU work of a background save in a helper process, so that it never holds the training's GIL.

An async save's background thread runs DCP's planning, the ``.metadata`` pickle, every tensor's archive
and every chunk's digest in Python: under the GIL, against the training thread beside it (issue 42: the
steps of a transformer stack that ran while a save was in flight took 2.04 x as long). Where it is safe
(:func:`usable`), that work runs in a helper process of the manager's own instead, as stock DCP's
``AsyncCheckpointerType.PROCESS`` does:

- the snapshot's buffers are carved from shared memory (:class:`SharedArena`: ``memfd`` slabs, each
  handed to the helper once over a Unix socket), so a save hands over no tensor bytes, only the
  snapshot's structure (a pickle whose tensors are (slab, offset, dtype, shape) references);
- the helper (a fresh interpreter, ``python -m`` this module, started at the first such save) writes
  the step's data files and ``.metadata`` into a store of its own over the same folder and answers,
  as JSON, the ``files`` record the manifest lists, or its error (an ``OSError`` with its errno,
  filename and message; anything else as the contract's kind and exit code, :class:`CarriedError`);
- the save's thread waits for that answer in a socket read, without the GIL; the commit (fence,
  manifest, ``latest.json``, retention) stays on it, under the write lease its heartbeat renews: the
  commit protocol is the one of a thread save, and the manifest, written last, only by the parent.

A helper that dies before it answers (killed, out of memory) fails the save with exit 137 (killed, a
restart's code); nothing it wrote is committed, and the next save starts a new helper. A helper whose
parent died exits within half a second (it polls its parent id), whatever it was doing.

Where it is not used, the save's thread writes as before: with ``torch.distributed`` (DCP's
collectives stay with their group), on a store other than a plain :class:`~..store.file.FileStore` (a
network store's client, credentials and hooks are the parent's), and when the snapshot lives in the
CUDA driver's pinned memory (CUDA initialised).
"""

from __future__ import annotations

import io
import json
import mmap
import os
import pickle
import socket
import struct
import subprocess
import sys
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable

from ..contract.classify import CarriedError, dcp_original
from ..contract.errors import error_for
from ..contract.exitcodes import ExitCode
from ..store.file import FileStore

if TYPE_CHECKING:
    import torch

SLAB_BYTES = 64 << 20  # the shared memory of snapshot buffers is mapped in slabs of at least this
ALIGN = 64
_HEADER = struct.Struct("<cQ")  # frame: kind, payload length


def usable(store: Any, distributed: bool) -> bool:
    """Whether a background save of ``store`` in this process may write from the helper."""
    if distributed or type(store) is not FileStore or not hasattr(os, "memfd_create") \
            or not hasattr(socket, "send_fds"):
        return False
    torch = sys.modules.get("torch")
    return torch is None or not torch.cuda.is_initialized()


def root_of(store: Any) -> str:
    """The folder of a store :func:`usable` accepted (the helper opens its own store over it)."""
    return str(store.root)


def dcp_write(store: Any, key: str, snapshot: Any, *, files_per_rank: int, threads: int,
              group: Any = None) -> dict[str, dict[str, Any]]:
    """``dcp.save`` of ``snapshot`` into ``key`` of ``store`` (this rank's files), the collector paused;
    DCP's wrapper of a failure unwrapped. The ``files`` record of what this rank wrote."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner
    from torch.distributed.checkpoint.api import CheckpointException

    from .dcp_io import StoreWriter, collector_paused

    writer = StoreWriter(store, key, files_per_rank=files_per_rank, threads=threads)
    # a snapshot holds plain tensors and DTensors, never a ShardedTensor: DCP's pass flattening
    # those (a walk of every value, ~15 % of its planning) has nothing to do
    planner = DefaultSavePlanner(flatten_sharded_tensors=False)
    try:
        with collector_paused():
            dcp.save(snapshot, storage_writer=writer, planner=planner, process_group=group)
    except CheckpointException as err:  # DCP wraps what the store raised: surface that
        raise dcp_original(err) from None
    return writer.files


_slabs_lock = threading.Lock()
_slab_ids = iter(range(1 << 62))
_slab_fds: dict[int, tuple[int, int]] = {}  # slab id -> (memfd, bytes), while its arena lives
_dropped: list[int] = []  # slabs whose arena is gone: the helper unmaps them at its next save


def _forget_slabs(ids: list[int]) -> None:
    with _slabs_lock:
        for slab in ids:
            fd, _ = _slab_fds.pop(slab, (-1, 0))
            if fd >= 0:
                os.close(fd)
            _dropped.append(slab)


class SharedArena:
    """Allocates the snapshot's buffers in ``memfd`` slabs that the helper maps too (one fd a slab,
    not one a tensor: a state of 16,384 tensors would exceed a process's open files). A slab is
    unmapped by the helper once its arena is collected (the manager closed)."""

    def __init__(self) -> None:
        self.slabs: list[tuple[int, int, Any]] = []  # (slab id, bytes, uint8 tensor over its mapping)
        self._ids: list[int] = []
        self._used = 0  # bytes used of the last slab
        weakref.finalize(self, _forget_slabs, self._ids)

    def empty(self, shape: Any, dtype: torch.dtype) -> torch.Tensor:
        import torch

        nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
        if not nbytes:
            return torch.empty(shape, dtype=dtype)
        at = -(-self._used // ALIGN) * ALIGN
        if not self.slabs or at + nbytes > self.slabs[-1][1]:
            size = max(SLAB_BYTES, -(-nbytes // ALIGN) * ALIGN)
            fd = os.memfd_create("relaunch-snapshot", os.MFD_CLOEXEC)
            os.ftruncate(fd, size)
            region = mmap.mmap(fd, size)  # the tensor over it keeps it mapped
            with _slabs_lock:
                slab = next(_slab_ids)
                _slab_fds[slab] = (fd, size)
            self._ids.append(slab)
            self.slabs.append((slab, size, torch.frombuffer(region, dtype=torch.uint8)))
            at = 0
        self._used = at + nbytes
        return self.slabs[-1][2][at:at + nbytes].view(dtype).view(shape)

    def where(self, tensor: torch.Tensor) -> tuple[int, int] | None:
        """(slab id, byte offset) of a contiguous tensor that lies in a slab, else None."""
        if not tensor.is_contiguous() or tensor.device.type != "cpu":
            return None
        ptr = tensor.data_ptr()
        for slab, size, region in self.slabs:
            base = region.data_ptr()
            if base <= ptr < base + size:
                return slab, ptr - base
        return None


class Helper:
    """The process's helper and its socket (:func:`helper`): started in the background by the first
    :meth:`ready`, so that no save waits for its interpreter to start (saves write on their thread
    until it is); restarted the same way after it died. One save at a time talks to it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # one save's exchange at a time
        self._proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._mapped: set[int] = set()  # slabs the helper has
        self._up = threading.Event()
        self._starting: threading.Thread | None = None

    def ready(self, wait: bool = False) -> bool:
        """Whether the helper is up; starts it in the background when it is not (``wait``: until it is)."""
        with self._lock:
            if self._up.is_set() and self._proc is not None and self._proc.poll() is None:
                return True
            if self._starting is None or not self._starting.is_alive():
                self._stop()
                self._starting = threading.Thread(target=self._start, name="ckpt-helper-start", daemon=True)
                self._starting.start()
            starting = self._starting
        if wait:
            starting.join()
            return self._up.is_set()
        return False

    def _start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            proc = subprocess.Popen([sys.executable, "-m", __name__, str(theirs.fileno())],
                                    pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
        except OSError:
            ours.close()
            return
        finally:
            theirs.close()
        try:
            kind, _, _ = _recv_frame(ours)  # the helper has imported what it writes with
        except (OSError, EOFError):
            kind = b""
        with self._lock:
            self._proc, self._sock, self._mapped = proc, ours, set()
            if kind == b"H":
                self._up.set()

    def _stop(self) -> None:
        """Under the lock: forget a helper that died (or never came up)."""
        self._up.clear()
        sock, proc, self._sock, self._proc = self._sock, self._proc, None, None
        if sock is not None:
            sock.close()
        if proc is not None and proc.poll() is None:
            proc.kill()
        if proc is not None:
            proc.wait()

    def write(self, arena: SharedArena, snapshot: Any, root: str, key: str, *, files_per_rank: int,
              threads: int, what: str, fallback: Callable[[], dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
        """``dcp_write`` of ``snapshot`` into ``key`` of the folder store ``root``, in the helper; by
        ``fallback()`` (the save's thread) when the snapshot holds an object the helper cannot rebuild
        (a class of the trainer's ``__main__``, an object that does not pickle)."""
        import torch

        body = io.BytesIO()
        pickler = pickle.Pickler(body, protocol=pickle.HIGHEST_PROTOCOL)

        def persistent_id(obj: Any) -> Any:
            if isinstance(obj, torch.Tensor) and type(obj) is torch.Tensor:
                place = arena.where(obj)
                if place is not None:
                    return (place[0], place[1], str(obj.dtype).removeprefix("torch."), tuple(obj.shape))
            return None

        pickler.persistent_id = persistent_id  # type: ignore[method-assign]
        try:
            pickler.dump(snapshot)
        except Exception:  # noqa: BLE001 - not every object of a state pickles; the thread writes it
            return fallback()
        head = json.dumps({"root": root, "key": key, "files_per_rank": files_per_rank, "threads": threads}).encode()
        payload = struct.pack("<Q", len(head)) + head + body.getbuffer()
        with self._lock:
            sock, proc = self._sock, self._proc
            if sock is None or proc is None:
                return fallback()
            reply = None
            try:
                with _slabs_lock:
                    dropped = [s for s in _dropped if s in self._mapped]
                    _dropped.clear()
                    new = [(slab, _slab_fds[slab]) for slab, _, _ in arena.slabs if slab not in self._mapped]
                    if dropped:
                        sock.sendall(_frame(b"D", json.dumps(dropped).encode()))
                        self._mapped.difference_update(dropped)
                    for slab, (fd, size) in new:  # sent under the registry's lock: no fd is closed meanwhile
                        socket.send_fds(sock, [_frame(b"S", struct.pack("<QQ", slab, size))], [fd])
                        self._mapped.add(slab)
                sock.sendall(_HEADER.pack(b"W", len(payload)))
                sock.sendall(payload)
                _, reply, _ = _recv_frame(sock)
            except (OSError, EOFError):
                pass
            if reply is None:
                try:
                    status = proc.wait(timeout=5)
                    how = f"was killed by signal {-status}" if status < 0 else f"exited {status}"
                except subprocess.TimeoutExpired:
                    how = "stopped answering"
                self._stop()
                raise error_for(ExitCode.KILLED, f"the checkpoint writer process {proc.pid} {how} before it "
                                                 f"finished {what}; nothing of it was committed")
        answer = json.loads(reply)
        if "ok" in answer:
            return answer["ok"]
        if "unpickled" in answer:
            return fallback()
        raise _rebuilt(answer["err"])

    @property
    def pid(self) -> int | None:
        """The helper's process id while it runs."""
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None


_helper: Helper | None = None
_helper_lock = threading.Lock()


def helper() -> Helper:
    """This process's helper (one for every manager of the process)."""
    global _helper
    with _helper_lock:
        if _helper is None:
            _helper = Helper()
        return _helper


def _forget_helper() -> None:  # a forked child talks to no helper of its parent's (its own starts if needed)
    global _helper, _helper_lock
    _helper, _helper_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_helper)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        part = sock.recv(min(n - len(out), 1 << 20))
        if not part:
            raise EOFError
        out += part
    return bytes(out)


def _recv_frame(sock: socket.socket) -> tuple[bytes, bytes, list[int]]:
    """(kind, payload, fds received with the frame); EOFError at the socket's end."""
    head, fds = b"", []
    while len(head) < _HEADER.size:
        data, got, _, _ = socket.recv_fds(sock, _HEADER.size - len(head), 1)
        if not data:
            raise EOFError
        head += data
        fds += got
    kind, length = _HEADER.unpack(head)
    return kind, _recv_exact(sock, length), fds


def _carried(err: BaseException) -> dict[str, Any]:
    if isinstance(err, OSError) and err.errno:
        return {"errno": err.errno, "strerror": err.strerror,
                "filename": None if err.filename is None else str(err.filename)}
    carried = CarriedError.of(err)
    return {"exit_code": carried.exit_code, "kind": carried.kind, "message": carried.message}


def _rebuilt(err: dict[str, Any]) -> BaseException:
    if "errno" in err:
        if err["filename"] is None:
            return OSError(err["errno"], err["strerror"])
        return OSError(err["errno"], err["strerror"], err["filename"])  # FileNotFoundError, ... by errno
    return CarriedError(int(err["exit_code"]), str(err["kind"]), str(err["message"])).rebuild()


# ------------------------------------------------------------------------------ the helper's side

def _watch_parent(parent: int) -> None:
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            os._exit(70)


def serve(fd: int) -> None:
    """The helper's loop: slabs mapped as they come, each save written and answered, until the
    socket ends."""
    import warnings

    import torch

    # one process, as the manager's own: DCP's note about it is noise (manager.py filters it there)
    warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled, unavailable or uninitialized")
    threading.Thread(target=_watch_parent, args=(os.getppid(),), name="parent-watch", daemon=True).start()
    sock = socket.socket(fileno=fd)
    slabs: dict[int, torch.Tensor] = {}
    import torch.distributed.checkpoint  # noqa: F401 - imported before it says it is up

    from . import dcp_io  # noqa: F401

    sock.sendall(_frame(b"H", b""))  # up: what it writes with is imported

    class Unpickler(pickle.Unpickler):
        def persistent_load(self, pid: Any) -> Any:  # the parent's references to its slabs
            slab, at, dtype, shape = pid
            dt = getattr(torch, dtype)
            nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dt).element_size()
            return slabs[slab][at:at + nbytes].view(dt).view(shape)

    while True:
        try:
            kind, payload, fds = _recv_frame(sock)
        except (EOFError, ConnectionError):
            return
        if kind == b"S":
            slab, size = struct.unpack("<QQ", payload)
            region = mmap.mmap(fds[0], size)
            os.close(fds[0])
            slabs[slab] = torch.frombuffer(region, dtype=torch.uint8)
            continue
        if kind == b"D":
            for slab in json.loads(payload):
                slabs.pop(slab, None)
            continue
        (n,) = struct.unpack("<Q", payload[:8])
        head = json.loads(payload[8:8 + n])
        try:
            snapshot = Unpickler(io.BytesIO(payload[8 + n:])).load()
        except Exception:  # noqa: BLE001 - an object the helper cannot rebuild: the parent's thread writes
            sock.sendall(_frame(b"R", json.dumps({"unpickled": False}).encode()))
            continue
        try:
            answer: dict[str, Any] = {"ok": dcp_write(FileStore(head["root"]), head["key"], snapshot,
                                                      files_per_rank=head["files_per_rank"],
                                                      threads=head["threads"])}
        except BaseException as err:  # noqa: BLE001 - carried to the parent, which raises it
            answer = {"err": _carried(err)}
        sock.sendall(_frame(b"R", json.dumps(answer).encode()))


def _frame(kind: bytes, data: bytes) -> bytes:
    return _HEADER.pack(kind, len(data)) + data


if __name__ == "__main__":
    serve(int(sys.argv[1]))
