"""Where a training starts: one rule, here, decided by the training's workers when they load.

The rule, in order: the newest committed checkpoint of this training (a restarted pipeline, or a
group torchrun restarted inside one launch, continues from the last commit), else ``train.resume_from``
(the whole training state), else the checkpoint behind ``train.warm_start_model`` (a registered model
version: its weights only, training starts at step 0), else nothing. The checkpoint named is checked in
O(1) here (manifest, files, sizes, model); its bytes are verified once, by the read that loads them.

Who decides: the workers (``restore`` in the trainer's ``setup``), at the moment they load; rank 0
decides and every rank gets its answer. The ``locate-latest-checkpoint`` step only *reports* the same
rule's answer as of the moment it runs (for the pipeline's console and UI), and launch hands that answer
to the workers as ``train.resume_from``. Handed on, it never changes the decision: it names a committed
checkpoint of this training (the newest committed one, the same or newer, wins over it), the user's own
``resume_from``, or the warm-start checkpoint (recognised as such: weights only). So a locate answer
that went stale (a checkpoint committed after locate ran, e.g. by the group torchrun restarted) is
superseded by the newer commit, never resumed from.

The registry lookup of a warm start is a parameter (``warm_start_lookup``: the tracking room's
``warm_start_checkpoint``, passed in by the callers above), so this room imports nothing of tracking.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from .layout import parse_checkpoint_uri, read_manifest
from .verify import check_files
from ..contract.errors import BadInput, CorruptCheckpoint
from ..runtime.distributed import agree, on_rank0
from ..store import open_store

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


def start_point(config: Any, manager: Any, *, warm_start_lookup: WarmStartLookup | None = None,
                fingerprint: Callable[[], str] | None = None) -> StartPoint:
    """Decide where the training of ``config`` starts by the rule above (collective under
    torch.distributed: rank 0 decides, every rank gets the answer).

    ``resume_from`` equal to the warm-start model's checkpoint is a warm start: that is what a
    pipeline hands its launch step after locate chose the warm start.

    Args:
        config: the training's configuration (``train.resume_from``, ``train.warm_start_model``).
        manager: the training's open CheckpointManager (its store's newest committed checkpoint).
        warm_start_lookup: the registry lookup of ``train.warm_start_model``; needed only when it is set.
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


def _decide(config: Any, fingerprint: Callable[[], str] | None, lookup: WarmStartLookup | None) -> StartPoint:
    train = config.train
    if train.resume_from and not train.warm_start_model:
        return StartPoint("resume_from", train.resume_from, checked_step(train.resume_from, fingerprint))
    if train.warm_start_model:
        if lookup is None:
            raise TypeError("start_point needs a warm_start_lookup when train.warm_start_model is set")
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


def checked_step(uri: str, fingerprint: Callable[[], str] | None = None) -> int:
    """The step of the committed checkpoint at ``uri``, after an O(1) check (manifest, files and
    sizes); with ``fingerprint``, also that it holds the model this task builds.

    Raises:
        BadInput: not a committed relaunch checkpoint (or unreadable), or another model.
    """
    store_uri, step = parse_checkpoint_uri(uri)
    store = open_store(store_uri)
    try:
        manifest = read_manifest(store, step)
        check_files(store, step, manifest)
    except (CorruptCheckpoint, FileNotFoundError) as err:
        raise BadInput(f"train.resume_from: {uri!r} is not a committed relaunch checkpoint ({err})") from None
    theirs = manifest.get("model_fingerprint")
    if fingerprint is not None and theirs:
        mine = fingerprint()
        if theirs != mine:
            raise BadInput(f"train.resume_from: {uri!r} holds another model (fingerprint {theirs}, the task "
                           f"builds {mine}); check train.task and its sizes")
    return step
