"""Where a training process starts, first or replacement: one function, :func:`start`, and one rule.

In order:

1. **memory** (``train.memory_tier``, under the in-place agent): the newest step that every rank can serve
   from the tier (its own snapshots, or a replacement's replicas on its holder), unless a later step is
   committed in the store (:meth:`relaunch.components.core.recovery.in_place.InPlace.from_memory`);
2. the **newest committed checkpoint** of this training (a restarted pipeline, or a group torchrun
   restarted inside one launch, continues from the last commit);
3. ``train.resume_from`` (the whole training state);
4. the checkpoint behind ``train.warm_start_model`` (a registered model version: its weights only,
   training starts at step 0);
5. nothing: step 0.

Steps 2-5 are :func:`start_point`'s rule. The checkpoint named is checked in O(1) there (manifest, files,
sizes, model); its bytes are verified once, by the read that loads them.

Who decides: the workers, at the moment they load; rank 0 decides and every rank gets its answer. The
``locate-latest-checkpoint`` step only *reports* the rule's answer as of the moment it runs (for the
pipeline's console and UI), and launch hands that answer to the workers as ``train.resume_from``. Handed
on, it never changes the decision: it names a committed checkpoint of this training (the newest committed
one, the same or newer, wins over it), the user's own ``resume_from``, or the warm-start checkpoint
(recognised as such: weights only). So a locate answer that went stale (a checkpoint committed after
locate ran, e.g. by the group torchrun restarted) is superseded by the newer commit, never resumed from.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Any, Callable, Protocol

from ..checkpoint.layout import parse_checkpoint_uri
from ..checkpoint.verify import checked_step
from ..contract.errors import BadInput
from ..runtime.distributed import agree, on_rank0
from ..tracking.warm_start import warm_start_checkpoint

WarmStartLookup = Callable[[Any], str]
"""The checkpoint URI behind ``config.train.warm_start_model`` (raises BadInput when there is none)."""


@dataclasses.dataclass
class StartPoint:
    """What a training starts from: ``source`` is "latest", "resume_from", "warm_start" or "none"."""

    source: str
    uri: str
    step: int

    @property
    def weights_only(self) -> bool:
        """A warm start loads the model's weights, never optimizer, scheduler, step or RNG."""
        return self.source == "warm_start"


def start_point(config: Any, manager: Any, *, warm_start_lookup: WarmStartLookup = warm_start_checkpoint,
                fingerprint: Callable[[], str] | None = None) -> StartPoint:
    """Decide where the training of ``config`` starts by the rule above (collective under
    torch.distributed: rank 0 decides, every rank gets the answer).

    ``resume_from`` equal to the warm-start model's checkpoint is a warm start: that is what a
    pipeline hands its launch step after locate chose the warm start.

    Args:
        config: the training's configuration (``train.resume_from``, ``train.warm_start_model``).
        manager: the training's open CheckpointManager (its store's newest committed checkpoint).
        warm_start_lookup: the registry lookup of ``train.warm_start_model`` (default: the tracking
            server's model registry).
        fingerprint: this task's model fingerprint, to refuse a ``resume_from`` of another model early.

    Raises:
        BadInput: ``resume_from`` is not a committed relaunch checkpoint or holds another model
            (``fingerprint`` gives this task's), the warm-start model version does not exist or has
            no checkpoint, or a checkpoint of a newer format.
    """
    latest = manager.latest()
    if latest is not None:
        return StartPoint("latest", latest.uri, latest.step)
    decided = on_rank0(manager.rank, lambda: _decide(config, fingerprint, warm_start_lookup))
    return agree(decided, manager.group, manager.rank, manager.world_size)


def _decide(config: Any, fingerprint: Callable[[], str] | None, lookup: WarmStartLookup) -> StartPoint:
    train = config.train
    if train.resume_from and not train.warm_start_model:
        return StartPoint("resume_from", train.resume_from, checked_step(train.resume_from, fingerprint))
    if train.warm_start_model:
        uri = lookup(config)
        source = "warm_start" if not train.resume_from or _same(train.resume_from, uri) else "resume_from"
        if source == "resume_from":
            uri = train.resume_from
        return StartPoint(source, uri, checked_step(uri, fingerprint))
    return StartPoint("none", "", -1)


def _same(a: str, b: str) -> bool:
    try:
        return parse_checkpoint_uri(a) == parse_checkpoint_uri(b)
    except BadInput:
        return False


@dataclasses.dataclass
class Restored:
    """Where this attempt starts: ``uri`` ("" for a fresh start; ``memory://step-N`` from the tier), the
    checkpoint loaded as the newest committed one (None otherwise), and the step the training continues
    from (-1: from scratch)."""

    uri: str
    committed: Any
    step: int


@dataclasses.dataclass
class Start:
    """How a process started: ``source`` "memory" or "store", the step, the store bytes read (counted
    under the in-place agent), and how long it took."""

    restored: Restored
    source: str
    detail: str
    store_bytes_read: int
    seconds: float
    taken_at: float | None = None  # when the restored step was done (a snapshot's), if known
    saved_step: int = -1  # the newest step at or before it committed in the store (a memory step may be none:
    # the save of the training's last step, its peer lost before the commit, must not be skipped as done)


class Memory(Protocol):
    """The tier's side of a start (:class:`~relaunch.components.core.recovery.in_place.InPlace`)."""

    bytes_read: int
    rank: int

    def from_memory(self, manager: Any, parts: Any, peers: Callable[[], Any]) -> tuple[Start | None, str]: ...


def start(config, manager, parts, peers: Callable[[], Any], *, memory: Memory | None = None,
          warm_up: Callable[[], None] | None = None) -> Start:
    """Start this process's training where the rule above says, on every rank (collective): from memory
    when ``memory`` (the in-place side of a worker) can serve every rank, else from the store by
    :func:`start_point`. ``warm_up`` (DDP's first buckets) runs first, every start alike; ``peers()`` wraps
    the collectives (a peer dying in them is a retryable failure)."""
    began, read_before = time.perf_counter(), memory.bytes_read if memory is not None else 0
    if warm_up is not None:
        with peers():
            warm_up()
    started, detail = memory.from_memory(manager, parts, peers) if memory is not None else (None, "")
    if started is None:
        restored = load_start(config, manager, parts, peers)
        started = Start(restored, "store", detail, 0, 0.0, saved_step=restored.step)
    started.seconds = time.perf_counter() - began
    if memory is not None:
        started.store_bytes_read = memory.bytes_read - read_before
        print(f"relaunch: rank {memory.rank} (pid {os.getpid()}) restored step {started.restored.step} from "
              f"{started.source}{' (' + started.detail + ')' if started.detail else ''}; {started.store_bytes_read} "
              f"bytes read from the store", file=sys.stderr, flush=True)
    return started


def load_start(config, manager, parts, peers: Callable[[], Any]) -> Restored:
    """Decide the start point in the store and load it on every rank: the whole training state, or the
    model's weights alone for a warm start. The decision is :func:`start_point`'s, at this moment, so a
    group torchrun restarted resumes from the newest commit, whatever the locate step reported before."""
    from ..trainer.state import ModelWeights  # torch: the locate step reports start_point without it

    with peers():
        point = start_point(config, manager)
    uri, committed = point.uri, None
    with peers():
        if point.weights_only:
            manager.load(ModelWeights(parts.module), uri=uri)
        elif point.source == "latest":  # a checkpoint found damaged while read: the previous one, together
            committed = manager.load(parts.state)
            uri = committed.uri if committed is not None else ""
        elif uri:
            manager.load(parts.state, uri=uri)
    step = int(parts.state.step) if uri and not point.weights_only else -1
    return Restored(uri, committed, step)
