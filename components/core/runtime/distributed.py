"""The distributed environment as torchrun and the Kubeflow Training Operator set it, the process
group, and the few collectives the trainer and the checkpoint manager need (rank-0 decisions
broadcast to every rank; every rank's outcome agreed on, errors crossing ranks as ``CarriedError``).

torchrun sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``,
``MASTER_ADDR``/``MASTER_PORT``, ``TORCHELASTIC_RESTART_COUNT`` and ``TORCHELASTIC_RUN_ID``; the
Training Operator sets ``PET_NNODES``, ``PET_NPROC_PER_NODE``, ``PET_NODE_RANK``, ``PET_MASTER_ADDR``,
``PET_MASTER_PORT`` for torchrun to read. A plain ``python -m relaunch.components.train`` is a world of one.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import stat
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from ..contract.classify import CarriedError
from ..contract.errors import BadInput, TransientFailure
from .generations import GENERATION_ENV, joined_key
from .net import free_port

if TYPE_CHECKING:
    import torch

# torch is imported where it is used: the checkpoint manager (and the locate step, which imports no
# torch) use the agreement helpers below without a process group.

T = TypeVar("T")
Outcome = tuple[str, Any]  # ("ok", value) or ("err", exception): one rank's result, handed to agree()


def _int(name: str, default: int, *fallbacks: str) -> int:
    for key in (name, *fallbacks):
        raw = os.environ.get(key)
        if raw not in (None, ""):
            try:
                return int(raw)
            except ValueError:
                raise BadInput(f"environment variable {key}={raw!r} is not an integer") from None
    return default


@dataclass(frozen=True)
class DistEnv:
    """Who this process is in the training job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    nodes: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    restart_count: int = 0
    elastic_run_id: str = ""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def launched(self) -> bool:
        """Whether a launcher (torchrun) set the environment, rather than a plain single process."""
        return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def read_env() -> DistEnv:
    """Read the environment torchrun / the Training Operator set; defaults are a world of one.

    Raises:
        BadInput: a variable that is not an integer, or ranks out of range.
    """
    world = _int("WORLD_SIZE", 1)
    rank = _int("RANK", 0)
    local_world = _int("LOCAL_WORLD_SIZE", 1, "PET_NPROC_PER_NODE")
    env = DistEnv(
        rank=rank, world_size=world, local_rank=_int("LOCAL_RANK", 0), local_world_size=local_world,
        node_rank=_int("GROUP_RANK", 0, "PET_NODE_RANK", "NODE_RANK"),
        nodes=max(1, world // max(1, local_world)),
        master_addr=os.environ.get("MASTER_ADDR") or os.environ.get("PET_MASTER_ADDR") or "127.0.0.1",
        master_port=_int("MASTER_PORT", 0, "PET_MASTER_PORT"),
        restart_count=_int("TORCHELASTIC_RESTART_COUNT", 0),
        elastic_run_id=os.environ.get("TORCHELASTIC_RUN_ID", ""),
    )
    if not 0 <= env.rank < env.world_size:
        raise BadInput(f"RANK={env.rank} is outside WORLD_SIZE={env.world_size}")
    return env


def backend() -> str:
    """``nccl`` when CUDA is present, else ``gloo``."""
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


def device(env: DistEnv) -> torch.device:
    """This rank's device: ``cuda:<local_rank>`` when CUDA is present, else the CPU."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.set_device(env.local_rank % torch.cuda.device_count())
        return torch.device("cuda", env.local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def init(env: DistEnv, timeout_seconds: float) -> None:
    """Initialise the default process group (also for a world of one, so collectives always work).

    Raises:
        TransientFailure: the rendezvous with the other ranks failed or timed out.
    """
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if not env.launched:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
    timeout = datetime.timedelta(seconds=timeout_seconds)
    try:
        before = _sockets()
        store = _restart_scoped_store(env, timeout)
        dist.init_process_group(backend=backend(), timeout=timeout, rank=env.rank, world_size=env.world_size,
                                store=store)
        _GROUP_SOCKETS[:] = [(fd, inode) for fd, inode in _sockets().items() if before.get(fd) != inode]
    except (RuntimeError, TimeoutError, ConnectionError) as err:
        raise TransientFailure(f"process group: rendezvous failed: {str(err).splitlines()[0][:200]}") from None


_GROUP_SOCKETS: list[tuple[int, int]] = []  # (fd, inode) of the sockets the process group's creation opened


def _sockets() -> dict[int, int]:
    """This process's open sockets, fd -> inode (empty where /proc is not there)."""
    found: dict[int, int] = {}
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError, ValueError):
                st = os.stat(f"/proc/self/fd/{name}")
                if stat.S_ISSOCK(st.st_mode):
                    found[int(name)] = st.st_ino
    return found


def sever() -> int:
    """Close the connections of the process group now (``shutdown(SHUT_RDWR)`` of each connected socket
    its creation opened and that is still the same socket; listeners and the descriptors themselves
    are left to the group), so that a peer blocked in one of its collectives fails at once with
    "connection closed" instead of waiting for the collective timeout. A gloo group closes its
    connections only when its last reference is gone, and the model and optimizer of a survivor hold
    it (DDP's reducer, FSDP2's parameter groups, the DTensors of its state). Call before
    :func:`shutdown`, after which the group is not used again. Returns the connections closed."""
    closed = 0
    for fd, inode in _GROUP_SOCKETS:
        with contextlib.suppress(OSError):
            if os.fstat(fd).st_ino != inode:
                continue
            sock = socket.socket(fileno=fd)
            try:
                if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):  # a listener's accept must not fail
                    sock.shutdown(socket.SHUT_RDWR)
                    closed += 1
            finally:
                sock.detach()
    _GROUP_SOCKETS.clear()
    return closed


def _restart_scoped_store(env: DistEnv, timeout: datetime.timedelta):
    """The agent's TCPStore, with keys scoped to this restart round (None: let ``env://`` do it).

    torchrun 2.13 shares one TCPStore server across rendezvous rounds and no longer prefixes the
    workers' keys per attempt, so a restarted rank can read the gloo address a dead rank published
    in the previous round and fail with "connectFullMesh ... Connection refused" (seen here about
    one restart in three). A prefix per restart count gives each round fresh keys. A worker of the
    in-place agent also marks, before any key of the round, that it enters it (``joined_key``: the
    agent replaces a rank lost without that mark within the same round).
    """
    import torch.distributed as dist

    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    client = dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=False, timeout=timeout)
    if os.environ.get(GENERATION_ENV):  # the in-place agent's worker: it tells the agent it enters this round
        client.set(joined_key(env.restart_count, env.rank), "1")
    return dist.PrefixStore(f"/relaunch/restart_{env.restart_count}/", client)


def shutdown() -> None:
    """Destroy the process group if there is one (idempotent)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank (plain Python values only)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def all_reduce_sum(values: list[float]) -> list[float]:
    """Element-wise sum over ranks of a few floats, in one collective (float64)."""
    import torch
    import torch.distributed as dist

    tensor = torch.tensor(values, dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        if backend() == "nccl":
            tensor = tensor.cuda()
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor.cpu().tolist()


def barrier() -> None:
    """Wait for every rank of the default process group (no-op in a world of one)."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def catch(fn: Callable[[], T]) -> Outcome:
    """Run ``fn`` and return its outcome: ``("ok", value)``, or ``("err", exception)`` for whatever it
    raised (also a BaseException: :func:`agree` re-raises it on every rank)."""
    try:
        return ("ok", fn())
    except BaseException as err:  # noqa: BLE001 - carried to every rank, re-raised by agree()
        return ("err", err)


def on_rank0(rank: int, fn: Callable[[], T]) -> Outcome:
    """Run ``fn`` on rank 0 only (:func:`catch`); other ranks get ``("ok", None)``. Hand the outcome
    to :func:`agree` so that every rank gets rank 0's value or error."""
    return catch(fn) if rank == 0 else ("ok", None)


def agree(outcome: Outcome, group: Any, rank: int, world_size: int, *, share: bool = True) -> Any:
    """Gather every rank's outcome over ``group`` (collective: every rank calls it); raise the first
    error on every rank (a rank's own as it is, another rank's rebuilt from its
    :class:`~relaunch.components.core.contract.classify.CarriedError`, with the same type and exit code), else
    return rank 0's value (``share``) or this rank's own.

    Args:
        outcome: this rank's ``("ok", value)`` or ``("err", exception)`` (:func:`catch`, :func:`on_rank0`).
        group: the process group; None for a single process without ``torch.distributed`` (the
            outcome is this process's: its error raised, else its value).
        rank, world_size: this rank and the size of ``group``.
        share: return rank 0's value on every rank (it must pickle); else each rank's own value.
    """
    kind, value = outcome
    if group is None:
        if kind == "err":
            raise value
        return value
    import torch.distributed as dist

    local = (kind, CarriedError.of(value) if kind == "err" else value)
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, local if share and rank == 0 or kind == "err" else ("ok", None),
                           group=group)
    for r, (k, v) in enumerate(gathered):
        if k == "err":
            if kind == "err":
                raise value
            raise v.rebuild(f"rank {r}: ")
    return gathered[0][1] if share else value


def node_groups(group: Any, world_size: int, per_node: int) -> tuple[Any, list[list[int]] | None]:
    """This rank's node group and the ranks of every node, for nodes of ``per_node`` consecutive
    ranks of ``group`` (a world of ``world_size``): one gloo group per node (collective: every rank
    makes every group, in the same order); ``group`` itself when one node holds every rank;
    ``(None, None)`` when the ranks do not split into such nodes."""
    import torch.distributed as dist

    if per_node <= 1 or world_size % per_node or per_node > world_size:
        return None, None
    ranks_of = [list(range(n, n + per_node)) for n in range(0, world_size, per_node)]
    if per_node == world_size:
        return group, ranks_of
    me, mine = dist.get_rank(), None
    for ranks in ranks_of:
        made = dist.new_group(ranks, backend="gloo")
        if me in ranks:
            mine = made
    return mine, ranks_of
