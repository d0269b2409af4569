"""The global sample order: a pure function of (seed, epoch, position), so a resume at any world size
skips exactly what was consumed.

An epoch's order is a two-level shuffle (MosaicML Streaming's idea, in its simplest form): the shards
in a seeded order, cut into windows of ``window_shards`` consecutive shards; each window's samples in a
seeded order of their own. A run of consecutive positions therefore touches the few shards of one or
two windows, and a loader holds those, not the dataset. Step ``s`` of an epoch consumes the positions
``[s * global_batch, (s + 1) * global_batch)``; rank ``r`` of ``W`` takes its ``global_batch / W``
of them (:func:`rank_positions`), so the samples of a step do not depend on the world size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

WINDOW_SHARDS = 4


@dataclass
class GlobalOrder:
    """``index(epoch, position)``: the global sample index at ``position`` of ``epoch``'s order over
    shards of ``shard_samples`` samples each (in manifest order: shard ``k`` holds the indices
    ``[starts[k], starts[k] + shard_samples[k])``)."""

    shard_samples: list[int]
    seed: int
    window_shards: int = WINDOW_SHARDS
    shuffle: bool = True
    _epoch: int = field(default=-1, repr=False)
    _window_ends: np.ndarray | None = field(default=None, repr=False)
    _windows: list[np.ndarray] = field(default_factory=list, repr=False)
    _cached: dict[int, np.ndarray] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.starts = np.concatenate([[0], np.cumsum(self.shard_samples)[:-1]]).astype(np.int64)
        self.total = int(sum(self.shard_samples))

    def _epoch_plan(self, epoch: int) -> None:
        if epoch == self._epoch:
            return
        n = len(self.shard_samples)
        shards = np.random.default_rng([self.seed, epoch, 0]).permutation(n) if self.shuffle else np.arange(n)
        self._windows = [shards[i:i + self.window_shards] for i in range(0, n, self.window_shards)]
        sizes = [int(sum(self.shard_samples[k] for k in w)) for w in self._windows]
        self._window_ends = np.cumsum(sizes)
        self._epoch, self._cached = epoch, {}

    def _window(self, epoch: int, w: int) -> np.ndarray:
        if w not in self._cached:
            if len(self._cached) > 2:  # a run of positions crosses at most one window boundary
                self._cached.pop(min(self._cached))
            indices = np.concatenate([np.arange(self.starts[k], self.starts[k] + self.shard_samples[k])
                                      for k in self._windows[w]])
            if self.shuffle:
                indices = np.random.default_rng([self.seed, epoch, 1, w]).permutation(indices)
            self._cached[w] = indices
        return self._cached[w]

    def indices(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        """The global sample indices at ``positions`` (each in ``[0, total)``) of ``epoch``."""
        self._epoch_plan(epoch)
        positions = np.asarray(positions, dtype=np.int64)
        windows = np.searchsorted(self._window_ends, positions, side="right")
        out = np.empty(len(positions), dtype=np.int64)
        for w in sorted(set(windows.tolist())):  # np.unique imports numpy.ma (~20 ms of a cold worker's start)
            mask = windows == w
            begin = int(self._window_ends[w - 1]) if w else 0
            out[mask] = self._window(epoch, int(w))[positions[mask] - begin]
        return out


def rank_positions(step_in_epoch: int, global_batch: int, rank: int, world_size: int) -> np.ndarray:
    """The positions of an epoch's order that ``rank`` consumes at a step (its slice of the global batch)."""
    local = global_batch // world_size
    start = step_in_epoch * global_batch + rank * local
    return np.arange(start, start + local, dtype=np.int64)
