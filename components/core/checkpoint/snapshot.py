"""The CPU snapshot a save takes of the training state, in buffers reused from save to save.

A synchronous snapshot copies every tensor in ``save()``. A deferred one (``save(defer_copy=True)``)
copies only the small state there and leaves the model parameters and optimizer state, which only
``optimizer.step()`` changes in place, to the save's background thread (:func:`copy_deferred`),
overlapped with the next forward and backward; the optimizers' next step waits for it
(:func:`optimizers_of` names them to the manager, which hooks their step).

The buffers are allocated (and page-faulted) by the first save and reused by every later one, as
DCP's stager keeps its CPU state dict. The copy in ``save()`` is cut into chunks that the training
thread and ``COPY_THREADS - 1`` helper threads take in turn (:func:`_parallel_copy`): on a quiet
machine the copy runs on every core it has, and a helper that is not scheduled (a busy machine)
costs at most one chunk, where a fixed split of the work (``Tensor.copy_``'s intra-op threads) waits
for the slowest thread.
"""

from __future__ import annotations

import copy
import os
import queue
import threading
from typing import TYPE_CHECKING, Any

from .torch_private import dtensor_like

if TYPE_CHECKING:
    import torch


def state_bytes(snapshot: Any) -> int:
    import torch

    total = 0

    def visit(obj: Any) -> None:
        nonlocal total
        if isinstance(obj, torch.Tensor):
            local = local_part(obj)
            total += local.numel() * local.element_size()
        elif isinstance(obj, dict):
            for v in obj.values():
                visit(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                visit(v)

    visit(snapshot)
    return total


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor`` (its local tensor if it is a DTensor, else itself), sharing its
    storage: no copy, and no autograd node even when it requires grad."""
    import torch
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return tensor
    with torch.no_grad():
        return tensor.to_local()


COPY_THREADS = max(1, min(4, os.cpu_count() or 1))  # threads of the copy in save(), the caller's included
COPY_CHUNK = 4 << 20  # bytes one thread copies before it takes the next (the wait for the last one is short)
SMALL_COPY = 64 << 10  # a tensor under this is copied right away by one copy_ (two numpy views cost more)

class _Helpers:
    """COPY_THREADS - 1 daemon threads that run the callables put on their queue. Daemon threads,
    not a ThreadPoolExecutor: an idle helper must never hold a process's exit up (an executor's
    workers are joined at exit, and a warm child's wind-down joins every non-daemon thread first)."""

    def __init__(self, count: int):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        for i in range(count):
            threading.Thread(target=self._loop, name=f"ckpt-copy-{i}", daemon=True).start()

    def _loop(self) -> None:
        while True:
            self.jobs.get()()


_pool: _Helpers | None = None
_pool_lock = threading.Lock()


def _forget_pool() -> None:  # a forked child has none of the parent's threads
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def _plain(src: torch.Tensor) -> bool:
    """A CPU tensor whose bytes are its values, front to back (numpy can view it)."""
    return src.device.type == "cpu" and src.is_contiguous() and bool(src.numel()) and not src.is_conj() \
        and not src.is_neg()


def _helpers() -> _Helpers:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = _Helpers(COPY_THREADS - 1)
        return _pool


def _parallel_copy(pairs: list[tuple[Any, Any]]) -> None:
    """Copy each (dest, src) pair of equal-length uint8 numpy views, in chunks of COPY_CHUNK taken in
    turn by this thread and up to COPY_THREADS - 1 helpers (numpy's copy releases the GIL). Returns
    when every chunk is copied; a helper that starts after that finds nothing left and is not waited for."""
    import numpy as np

    chunks = [(d[at:at + COPY_CHUNK], s[at:at + COPY_CHUNK]) for d, s in pairs for at in range(0, len(d), COPY_CHUNK)]
    if not chunks:
        return
    lock = threading.Lock()
    done = threading.Event()
    state = {"next": 0, "left": len(chunks)}
    errors: list[BaseException] = []

    def work() -> None:
        while True:
            with lock:
                i = state["next"]
                if i >= len(chunks):
                    return
                state["next"] = i + 1
            try:
                np.copyto(*chunks[i])
            except BaseException as err:  # noqa: BLE001 - raised by the caller, below
                errors.append(err)
            with lock:
                state["left"] -= 1
                if not state["left"]:
                    done.set()

    helpers = min(COPY_THREADS, len(chunks)) - 1
    if helpers > 0:
        pool = _helpers()
        for _ in range(helpers):
            pool.jobs.put(work)
    work()
    done.wait()
    if errors:
        raise errors[0]


def _byte_view(tensor: torch.Tensor) -> Any:
    import torch

    return tensor.reshape(-1).view(torch.uint8).numpy()


def _memcpy_unlocked(dest: torch.Tensor, src: torch.Tensor) -> None:
    """One plain memcpy of a contiguous CPU tensor, for the background thread (one thread: the
    training's forward and backward run beside it). numpy's copy releases the GIL, so the training
    thread's Python runs while the bytes move."""
    import numpy as np

    np.copyto(_byte_view(dest), _byte_view(src))


def _parts(state: Any) -> list[Any]:
    if isinstance(state, dict):
        return list(state.values())
    return [getattr(state, "model", None), getattr(state, "optimizer", None)]


def optimizers_of(state: Any) -> list[torch.optim.Optimizer]:
    """The optimizers ``state`` names (``state.optimizer``, or the values of a dict state)."""
    import torch

    return [part for part in _parts(state) if isinstance(part, torch.optim.Optimizer)]


def _storages(state: Any) -> set[int]:
    """The storages of the model parameters and optimizer state that ``state`` names: the tensors
    that only ``optimizer.step()`` (or a load) changes in place, so a snapshot may copy them while
    the next step's forward and backward read them. Every other tensor of the state (buffers such
    as BatchNorm statistics, which the forward updates; RNG states; extras) is copied in save()."""
    import torch

    tensors: list[Any] = []
    for part in _parts(state):
        if isinstance(part, torch.nn.Module):
            tensors += list(part.parameters())
        elif isinstance(part, torch.optim.Optimizer):
            tensors += [v for st in part.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    out = set()
    for t in tensors:
        ptr = local_part(t).untyped_storage().data_ptr()
        if ptr:
            out.add(ptr)
    return out


def _copy_into(buf: torch.Tensor, src: torch.Tensor, pin: bool) -> None:
    if _plain(src):
        _memcpy_unlocked(buf, src)
    else:
        buf.copy_(src, non_blocking=pin and src.is_cuda)


class Snapshotter:
    """Copies a training state to CPU buffers it keeps, one per state-dict path, for the next save."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        # where new buffers are allocated when set (a save_process.SharedArena: memory its helper maps)
        self.arena: Any = None

    def take(self, state: Any, deferred: list | None = None) -> Any:
        """A CPU copy of ``state.state_dict()`` that training can no longer change.

        With ``deferred`` (an async save), the copies of the model parameters and optimizer state
        are appended to it as (buffer, live tensor) for the background thread instead of made here;
        everything else (counters, RNG states, scheduler and scaler state, buffers) is copied now.
        """
        import torch

        if hasattr(state, "state_dict") and not isinstance(state, dict):
            sd = state.state_dict()
        else:
            sd = {k: (v.state_dict() if hasattr(v, "state_dict") and not isinstance(v, torch.Tensor) else v)
                  for k, v in dict(state).items()}
        later = _storages(state) if deferred is not None else set()
        host: list[tuple[Any, Any]] = []
        snapshot = self._copy(sd, "", torch.cuda.is_available(), later, deferred, host)
        _parallel_copy(host)
        return snapshot

    def _copy(self, obj: Any, path: str, pin: bool, later: set[int] = frozenset(), deferred: list | None = None,
              host: list | None = None) -> Any:
        import torch

        from torch.distributed.tensor import DTensor

        if isinstance(obj, DTensor):  # this rank's shard, re-wrapped so DCP still sees the global layout
            local = self._copy(local_part(obj), path, pin, later, deferred, host)
            return dtensor_like(local, obj)
        if isinstance(obj, torch.Tensor):
            src = obj.detach()
            buf = self._buffers.get(path)
            if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
                if self.arena is not None and not (pin and src.is_cuda):
                    buf = self.arena.empty(src.shape, src.dtype)
                else:
                    buf = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=pin and src.is_cuda)
                self._buffers[path] = buf
            if deferred is not None and src.untyped_storage().data_ptr() in later:
                deferred.append((buf, src))
            elif host is not None and _plain(src):
                if src.numel() * src.element_size() >= SMALL_COPY:
                    host.append((_byte_view(buf), _byte_view(src)))  # copied by take(), all at once
                else:
                    buf.copy_(src)
            else:
                _copy_into(buf, src, pin)
            return buf
        if isinstance(obj, dict):
            return {k: self._copy(v, f"{path}.{k}", pin, later, deferred, host) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            items = [self._copy(v, f"{path}.{i}", pin, later, deferred, host) for i, v in enumerate(obj)]
            return type(obj)(items) if isinstance(obj, list) else tuple(items)
        return copy.deepcopy(obj)


def copy_deferred(job: Any) -> None:
    """The background half of an async snapshot: ``job.copies`` (buffer, live tensor) on this thread,
    then ``job.copied`` is set, which ``CheckpointManager.wait_for_snapshot`` waits for."""
    import torch

    try:
        if job.cuda_ready is None:
            for buf, src in job.copies:
                _copy_into(buf, src, False)
        else:  # on a side stream: the training thread's forward kernels keep the default stream
            with torch.cuda.device(job.cuda_device):
                stream = torch.cuda.Stream()
                stream.wait_event(job.cuda_ready)
                with torch.cuda.stream(stream):
                    for buf, src in job.copies:
                        _copy_into(buf, src, True)
                stream.synchronize()
                job.cuda_ready.synchronize()  # the copies save() itself started
    finally:
        job.copies = []
        job.copied.set()
