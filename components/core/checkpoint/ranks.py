"""The ranks one checkpoint manager works over: its own gloo group, or a single process.

Every collaborator of the manager that decides on rank 0 and hands the answer to every rank does it
through one :class:`Ranks` (so that a background save's collectives never interleave with the
training's process group).
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, TypeVar

from ..runtime.distributed import Outcome, agree, catch, node_groups, on_rank0

T = TypeVar("T")


class Ranks:
    """This process's rank in the manager's group, the group's size, and its collectives.

    Args:
        group: the gloo group of the manager's collectives; None for a single process.
        rank, world_size: this process's rank in ``group`` and its size.
        node_group, node_ranks: the groups of the ranks that share a node (replicated state is read
            once per node), or None.
    """

    def __init__(self, group: Any = None, rank: int = 0, world_size: int = 1, node_group: Any = None,
                 node_ranks: list[list[int]] | None = None):
        self.group, self.rank, self.world_size = group, rank, world_size
        self.node_group, self.node_ranks = node_group, node_ranks

    @property
    def distributed(self) -> bool:
        """Whether the collectives go over a process group (else this process is the only rank)."""
        return self.group is not None

    @classmethod
    def of_this_process(cls, process_group: Any = None, ranks_per_node: int | None = None) -> "Ranks":
        """The ranks of this process: a new gloo group (or ``process_group``) when ``torch.distributed``
        is initialized (collective: every rank calls it), else a single process."""
        dist = sys.modules.get("torch.distributed")  # an initialized process group imported it already
        if dist is None or not dist.is_available() or not dist.is_initialized():
            return cls()
        group = process_group or dist.new_group(backend="gloo")
        world_size = dist.get_world_size(group)
        per_node = ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        node_group, node_ranks = node_groups(group, world_size, per_node)
        return cls(group, dist.get_rank(group), world_size, node_group, node_ranks)

    def catch(self, fn: Callable[[], T]) -> Outcome:
        """``fn``'s outcome on this rank (:func:`~relaunch.components.core.runtime.distributed.catch`)."""
        return catch(fn)

    def rank0(self, fn: Callable[[], T]) -> Outcome:
        """Run ``fn`` on rank 0 only; the outcome is handed to :meth:`agree`."""
        return on_rank0(self.rank, fn)

    def agree(self, outcome: Outcome, share: bool = True) -> Any:
        """Every rank's outcome agreed over the group (:func:`~relaunch.components.core.runtime.distributed.agree`)."""
        return agree(outcome, self.group, self.rank, self.world_size, share=share)
