"""What a training rank reads its batches from: a loader that starts at any step, with worker processes.

Three kinds, one interface (:class:`Loader`: ``batches(start_step)``, ``state_dict``, ``load_state_dict``,
``close``):

- :class:`ShardLoader`, a dataset committed in the store (what prepare writes): each rank streams the
  samples of its slice of each global batch (:mod:`.order`), fetched by ``num_workers`` loader
  processes that each hold the few shards of the current window, every shard checked against its
  digest as it is read. The position is the training's step: what a worker prefetched and was not
  consumed is fetched again after a resume, and a resume at another world size continues at the same
  global sample.
- :class:`MapLoader`, a task's own map-style ``Dataset``: the same global order over its indices.
- :class:`IterableLoader`, a task's own ``IterableDataset`` (it shards itself by rank) or its own
  stateful loader: torchdata's ``StatefulDataLoader`` (or the task's loader), whose ``state_dict`` (every
  worker's position, what was prefetched) is each rank's, checkpointed per rank; it resumes exactly at
  the world size it was saved at.
"""

from __future__ import annotations

import collections
import weakref
from typing import Any, Iterator, Protocol

import numpy as np
import torch

from ..contract.errors import BadInput, LoaderWorkerLost, RelaunchError, error_for
from .order import WINDOW_SHARDS, GlobalOrder, rank_positions
from .shards import Manifest, iter_rows, read_legacy_split, read_shard


class Loader(Protocol):
    """What the trainer reads its batches from (each rank its own)."""

    def batches(self, start_step: int) -> Iterator[dict[str, Any]]: ...
    def first_batch(self) -> Any: ...  # step 0's, without moving the loader (None when it cannot tell)
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...
    def close(self) -> None: ...


def rows_to_batch(rows: np.ndarray, index: np.ndarray | None = None) -> dict[str, torch.Tensor]:
    """Structured rows as a dict of tensors, one per field (``index``: their global sample indices)."""
    batch = {name: torch.from_numpy(np.ascontiguousarray(rows[name])) for name in rows.dtype.names}
    if index is not None:
        batch["index"] = torch.from_numpy(np.asarray(index, dtype=np.int64))
    return batch


def _as_is(batch: Any) -> Any:
    return batch


INLINE_BATCH_BYTES = 256 << 10
"""A shard worker's batch up to this size reaches the training process as numpy arrays pickled through
the loader's pipe: as tensors, torch hands each through shared memory and a socket connection to the
worker for its file descriptor, ~1 ms a tensor (measured, the batch ready: an LM batch of 4 KB 0.6 ms
instead of 2.4 ms, 256 KiB 1.1 against 2.2 ms; from 1 MiB on the pipe is the slower, 9.8 against 4.5 ms)."""


def as_tensors(batch: Any) -> Any:
    """A batch's numpy arrays (a shard worker's small batch) as tensors; anything else as it is."""
    if isinstance(batch, dict):
        return {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in batch.items()}
    return batch


FAILED = "__relaunch_failed__"


class WorkerPids:
    """The process ids of a loader's workers, each written by the worker as it starts (shared memory,
    inherited), so that a loader that fails can tell whether one of them died. Those of a loader in use
    are listed (:func:`loader_worker_loss` reads them) until :meth:`done`."""

    def __init__(self, count: int, *, leave_signals_to_the_rank: bool = True):
        import multiprocessing

        self.pids = multiprocessing.Array("q", max(count, 1), lock=False)
        self.leave_signals_to_the_rank = leave_signals_to_the_rank

    def start(self) -> None:
        """A pass begins: its workers will write their ids."""
        for i in range(len(self.pids)):
            self.pids[i] = 0
        _IN_USE.add(self)

    def done(self) -> None:
        _IN_USE.discard(self)

    def __call__(self, worker_id: int) -> None:  # the DataLoader's worker_init_fn
        import os
        import signal

        self.pids[worker_id] = os.getpid()
        # A SIGTERM or Ctrl-C sent to the rank's process group (a preemption, `relaunch run` stopping) is the
        # rank's to honour (it saves, then exits 143); its workers end with it (torch's watch of the parent).
        # Not for StatefulDataLoader's workers: it keeps its iterator, and they would outlive the rank.
        if self.leave_signals_to_the_rank:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)

    def lost(self) -> list[int]:
        """The workers that are gone (or dead, not yet reaped)."""
        import psutil

        gone = []
        for pid in self.pids:
            if pid <= 0:
                continue
            try:
                if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                    gone.append(pid)
            except psutil.NoSuchProcess:
                gone.append(pid)
        return gone


_IN_USE: "weakref.WeakSet[WorkerPids]" = weakref.WeakSet()


def loader_worker_loss(err: BaseException) -> LoaderWorkerLost | None:
    """What ``err`` is when a worker of a loader in use died: torch raises a bare ``RuntimeError`` for
    it, in the training process wherever its main thread is (from its ``SIGCHLD`` handler too), so the
    training asks here, about the processes, not the text, before taking it for anything else."""
    if not isinstance(err, RuntimeError) or isinstance(err, RelaunchError):
        return None
    lost = [pid for workers in list(_IN_USE) for pid in workers.lost()]
    if not lost:
        return None
    # the rank ends now: torch's handler would raise again at each other worker's exit on the way out
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    return LoaderWorkerLost(f"data-loader worker process {', '.join(map(str, lost))} died (SIGKILL or OOM)")


def each_batch(loader, workers: WorkerPids | None) -> Iterator[Any]:
    """A pass over a torch ``loader`` whose workers' ids ``workers`` holds; when one of them dies,
    :class:`LoaderWorkerLost`. However the pass ends (an error, the generator closed), its iterator is
    dropped at once, which stops the other workers and takes the pass's workers out of torch's
    ``SIGCHLD`` watch (an exception's traceback would otherwise keep it alive, and torch would raise
    again at each worker's exit)."""
    if workers is not None:
        workers.start()
    iterator = iter(loader)
    failure = None
    try:
        while True:
            try:
                batch = next(iterator)
            except StopIteration:
                return
            yield batch
    except RuntimeError as err:
        failure = loader_worker_loss(err)
        if failure is None:
            raise
    finally:
        del iterator
        if workers is not None:
            workers.done()
    raise failure


def raise_failure(batch: Any) -> Any:
    """``batch``, unless a loader worker sent a failure of the contract instead: raised here, with its
    kind, exit code and one line (an exception raised in a worker reaches the training process as
    its traceback's text)."""
    if isinstance(batch, dict) and FAILED in batch:
        code, kind, message = batch[FAILED]
        raise error_for(code, message, kind)
    return batch


class ShardRows(torch.utils.data.Dataset):
    """A split of a committed dataset as a map-style dataset of global sample indices, fetched whole
    batch at a time (``__getitems__``); each process (a loader worker) opens the store itself and keeps
    at most ``cache_shards`` shards, checked as they are read."""

    def __init__(self, store_uri: str, manifest: Manifest, split: str, cache_shards: int = WINDOW_SHARDS + 1):
        self.store_uri, self.manifest, self.split, self.cache_shards = store_uri, manifest, split, cache_shards
        self.shards = manifest.split(split)
        self.starts = np.concatenate([[0], np.cumsum([s.samples for s in self.shards])[:-1]]).astype(np.int64)
        self._store = None
        self._cache: collections.OrderedDict[int, np.ndarray] = collections.OrderedDict()

    def __len__(self) -> int:
        return int(sum(s.samples for s in self.shards))

    def _rows_of(self, k: int) -> np.ndarray:
        if k in self._cache:
            self._cache.move_to_end(k)
            return self._cache[k]
        if self._store is None:
            from ..store import open_store

            self._store = open_store(self.store_uri)
        if self.manifest.format == "npz":
            rows = read_legacy_split(self._store, self.manifest, self.split)
        else:
            rows = read_shard(self._store, self.shards[k], self.manifest.dtype)
        self._cache[k] = rows
        while len(self._cache) > self.cache_shards:
            self._cache.popitem(last=False)
        return rows

    def __getitems__(self, indices: list[int]) -> dict[str, Any]:
        try:
            batch = self._fetch(indices)
            if sum(t.nbytes for t in batch.values()) <= INLINE_BATCH_BYTES:
                return {k: t.numpy() for k, t in batch.items()}  # pickled inline (see INLINE_BATCH_BYTES)
            return batch
        except RelaunchError as err:  # to the training process as it is (a worker's exception arrives as text)
            return {FAILED: (int(err.exit_code), type(err).kind, str(err))}

    def _fetch(self, indices: list[int]) -> dict[str, torch.Tensor]:
        index = np.asarray(indices, dtype=np.int64)
        shard_of = np.searchsorted(self.starts, index, side="right") - 1
        rows = np.empty(len(index), dtype=self.manifest.dtype)
        for k in sorted(set(shard_of.tolist())):  # np.unique imports numpy.ma (~20 ms of a cold worker's start)
            mask = shard_of == k
            rows[mask] = self._rows_of(int(k))[index[mask] - self.starts[k]]
        return rows_to_batch(rows, index)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[0] for k, v in self._fetch([i]).items()}

    def __getstate__(self) -> dict[str, Any]:  # a spawned worker opens the store itself
        return {**self.__dict__, "_store": None, "_cache": collections.OrderedDict()}


class StepBatches(torch.utils.data.Sampler):
    """The global indices ``rank`` consumes at each step from ``start_step`` on, one list a step."""

    def __init__(self, order: GlobalOrder, steps_per_epoch: int, total_steps: int, global_batch: int,
                 rank: int, world_size: int, start_step: int):
        self.order, self.spe, self.total = order, steps_per_epoch, total_steps
        self.g, self.rank, self.world, self.start = global_batch, rank, world_size, start_step

    def __len__(self) -> int:
        return max(0, self.total - self.start)

    def __iter__(self) -> Iterator[list[int]]:
        for step in range(self.start, self.total):
            epoch, within = divmod(step, self.spe)
            yield self.order.indices(epoch, rank_positions(within, self.g, self.rank, self.world)).tolist()


class _OrderedLoader:
    """A map-style dataset read in the global order by a torch ``DataLoader`` with workers."""

    kind = "global-order"

    def __init__(self, dataset, order: GlobalOrder, *, steps_per_epoch: int, total_steps: int, global_batch: int,
                 rank: int, world_size: int, num_workers: int, prefetch_batches: int, seed: int,
                 collate=_as_is):
        self.dataset, self.order = dataset, order
        self.spe, self.total, self.g = steps_per_epoch, total_steps, global_batch
        self.rank, self.world = rank, world_size
        self.num_workers, self.prefetch, self.seed, self.collate = num_workers, prefetch_batches, seed, collate
        self._loader, self._workers, self._pass = None, None, None
        self.at = 0  # the step whose batch comes next

    def batches(self, start_step: int) -> Iterator[dict[str, Any]]:
        self.close()
        sampler = StepBatches(self.order, self.spe, self.total, self.g, self.rank, self.world, start_step)
        # its own generator: a loader's start must not draw from the training's torch RNG stream
        self._workers = WorkerPids(self.num_workers) if self.num_workers else None
        self._loader = torch.utils.data.DataLoader(
            self.dataset, batch_sampler=sampler, num_workers=self.num_workers, collate_fn=self.collate,
            prefetch_factor=self.prefetch if self.num_workers else None, worker_init_fn=self._workers,
            generator=torch.Generator().manual_seed(self.seed), persistent_workers=False)
        self.at = start_step
        self._pass = self._iterate()
        return self._pass

    def _iterate(self) -> Iterator[dict[str, Any]]:
        for batch in each_batch(self._loader, self._workers):
            batch = as_tensors(raise_failure(batch))
            if isinstance(batch, dict):
                batch["step"] = torch.tensor(self.at, dtype=torch.int64)
            self.at += 1
            yield batch

    def first_batch(self) -> Any:
        """This rank's batch of step 0, read here without workers and without moving the loader."""
        indices = next(iter(StepBatches(self.order, self.spe, self.total, self.g, self.rank, self.world, 0)))
        return as_tensors(raise_failure(self.collate(self.dataset.__getitems__(indices))))

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "next_step": int(self.at), "seed": int(self.seed),
                "samples": int(self.order.total), "global_batch": int(self.g)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to load: the position is the training's step, at any world size."""

    def close(self) -> None:
        """Stop the pass in progress and its workers (idempotent)."""
        if self._pass is not None:
            self._pass.close()
        self._pass, self._loader = None, None


class ShardLoader(_OrderedLoader):
    kind = "relaunch-shards"

    def __init__(self, store_uri: str, manifest: Manifest, split: str, **kwargs):
        rows = ShardRows(store_uri, manifest, split)
        order = GlobalOrder([s.samples for s in rows.shards], kwargs["seed"])
        super().__init__(rows, order, **kwargs)
        self.version = manifest.version

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "version": self.version}


class MapLoader(_OrderedLoader):
    kind = "map-dataset"

    def __init__(self, dataset, **kwargs):
        try:
            n = len(dataset)
        except TypeError:
            raise BadInput("the task's dataset has no len(): hand relaunch a map-style Dataset with __len__, or an "
                           "IterableDataset") from None
        order = GlobalOrder([n], kwargs["seed"], window_shards=1)
        super().__init__(_Indexed(dataset), order, collate=_collate_indexed, **kwargs)


class _Indexed(torch.utils.data.Dataset):
    def __init__(self, dataset):
        self.dataset = dataset

    def __getitems__(self, indices: list[int]) -> tuple[list[Any], list[int]]:
        return [self.dataset[i] for i in indices], indices

    def __len__(self) -> int:
        return len(self.dataset)


def _collate_indexed(fetched: tuple[list[Any], list[int]]) -> Any:
    samples, indices = fetched
    batch = torch.utils.data.default_collate(samples)
    if isinstance(batch, dict):
        batch["index"] = torch.tensor(indices, dtype=torch.int64)
    return batch


class IterableLoader:
    """A task's own ``IterableDataset`` (through torchdata's ``StatefulDataLoader``) or its own stateful
    loader (anything iterable with ``state_dict``/``load_state_dict``); an exhausted pass starts the next
    epoch (``set_epoch`` when the dataset or loader has one)."""

    kind = "stateful-loader"

    def __init__(self, source, *, local_batch: int, num_workers: int, prefetch_batches: int, seed: int,
                 world_size: int):
        self._workers = None
        if hasattr(source, "state_dict") and hasattr(source, "load_state_dict") and not isinstance(
                source, torch.utils.data.Dataset):
            self.loader, self.dataset = source, None
        else:
            from torchdata.stateful_dataloader import StatefulDataLoader

            self.dataset = source
            self._workers = WorkerPids(num_workers, leave_signals_to_the_rank=False) if num_workers else None
            self.loader = StatefulDataLoader(source, batch_size=local_batch, num_workers=num_workers,
                                             prefetch_factor=prefetch_batches if num_workers else None,
                                             worker_init_fn=self._workers,
                                             generator=torch.Generator().manual_seed(seed))
        self.world_size, self.epoch, self.at = world_size, 0, 0
        self._pending: dict[str, Any] | None = None
        self._pass: Iterator[dict[str, Any]] | None = None

    def batches(self, start_step: int) -> Iterator[dict[str, Any]]:
        """The batches from ``start_step`` on: the loader's own position, or the one its last
        :meth:`load_state_dict` gave (a resume's, a recovery's)."""
        self.close()
        self.at = start_step
        self._pass = self._iterate()
        return self._pass

    def _iterate(self) -> Iterator[dict[str, Any]]:
        while True:
            for target in (self.dataset, self.loader):
                if hasattr(target, "set_epoch"):
                    target.set_epoch(self.epoch)
            if self._pending is not None:
                self.loader.load_state_dict(self._pending)
                self._pending = None
            produced = False
            for batch in each_batch(self.loader, self._workers):
                raise_failure(batch)
                produced = True
                if isinstance(batch, dict):
                    batch["step"] = torch.tensor(self.at, dtype=torch.int64)
                self.at += 1
                yield batch
            if not produced:
                raise BadInput("the task's loader yielded no batch in a whole pass; check its dataset for this rank")
            self.epoch += 1

    def first_batch(self) -> None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "epoch": self.epoch, "world_size": self.world_size, "next_step": self.at,
                "loader": self.loader.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != self.kind:
            return
        if int(state.get("world_size", self.world_size)) != self.world_size:
            raise BadInput(f"the task's own loader was checkpointed at {state['world_size']} ranks and cannot resume "
                           f"exactly at {self.world_size}: resume at {state['world_size']} ranks, or hand relaunch a "
                           "map-style Dataset (its order is global, so any world size resumes it)")
        self.epoch = int(state["epoch"])
        self._pending = state["loader"]

    def close(self) -> None:
        if self._pass is not None:
            self._pass.close()
        self._pass = None


class SplitData:
    """A held-out split for a task's ``evaluate``: ``batches(n)`` streams its samples in stored order as
    dicts of tensors; ``split[field]`` is one field of the whole split as a numpy array (for small
    splits: a classifier's labels); ``len(split)``. Over a committed version (``store`` and
    ``manifest``), a task's own dataset (``dataset``) or rows in memory (``rows``: a preview)."""

    def __init__(self, store=None, manifest: Manifest | None = None, split: str = "", dataset=None,
                 rows: np.ndarray | None = None):
        self.store, self.manifest, self.split, self.dataset, self.rows = store, manifest, split, dataset, rows

    def __len__(self) -> int:
        if self.rows is not None:
            return len(self.rows)
        return self.manifest.samples(self.split) if self.manifest is not None else len(self.dataset)

    def _chunks(self) -> Iterator[np.ndarray]:
        if self.rows is not None:
            yield self.rows
        else:
            yield from iter_rows(self.store, self.manifest, self.split)

    def batches(self, batch_size: int) -> Iterator[dict[str, Any]]:
        if self.manifest is None and self.rows is None:
            yield from torch.utils.data.DataLoader(self.dataset, batch_size=batch_size)
            return
        buffered, count = [], 0
        for rows in self._chunks():
            at = 0
            while at < len(rows):
                take = rows[at:at + batch_size - count]
                buffered.append(take)
                count += len(take)
                at += len(take)
                if count == batch_size:
                    yield rows_to_batch(np.concatenate(buffered))
                    buffered, count = [], 0
        if count:
            yield rows_to_batch(np.concatenate(buffered))

    def arrays(self) -> dict[str, np.ndarray]:
        """Every field of the whole split (read whole: for small splits)."""
        if self.manifest is None and self.rows is None:
            batches = list(self.batches(1024))
            if not batches or not all(isinstance(b, dict) for b in batches):
                raise BadInput("split[field] needs samples that are dicts of tensors; iterate split.batches(n)")
            return {name: torch.cat([b[name] for b in batches]).numpy() for name in batches[0]}
        rows = np.concatenate(list(self._chunks()))
        return {name: np.ascontiguousarray(rows[name]) for name in rows.dtype.names}

    def __getitem__(self, field: str) -> np.ndarray:
        return self.arrays()[field]
