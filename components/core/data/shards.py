"""Datasets as committed shards in the store, written once, read back checked.

A dataset version is a set of shard files and one manifest, the commit point, as a checkpoint is:

    datasets/shards/<xxh3-128 of the shard>.bin     each shard, content-addressed: written once, shared
    datasets/<version>/MANIFEST.json                the splits, each shard's digest, size and sample count,
                                                    the sample's fields, the task's meta (its tokenizer)
    datasets/sources/<source key>.json              which version a source built (written with the
                                                    manifest, read only when the manifest is there: a
                                                    second prepare of it writes nothing)

A shard holds whole samples as packed rows of one numpy structured dtype (the fields in manifest order,
no padding), so sample ``i`` of a shard is bytes ``[i * row, (i + 1) * row)`` and
``numpy.frombuffer(shard, dtype=manifest.dtype)`` reads it with nothing but numpy. The version is
``sha256-`` + 16 hex digits of the manifest's canonical content (fields, shard digests, meta): the
same data always gets the same version. A shard is checked against its digest every time it is read;
a shard that does not match is :class:`~relaunch.components.core.contract.errors.CorruptDataset`.

Datasets stored before shards (``format: npz``, one ``splits.npz``) are still read, whole.
"""

from __future__ import annotations

import hashlib
import io
import json
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping

import numpy as np
import xxhash

from ..contract.errors import BadInput, CorruptDataset

PREFIX = "datasets"
SHARD_BYTES = 4 << 20
WRITE_THREADS = 8
"""Shards a writer has in flight at once: their writes and fsyncs overlap one another (a filesystem's
journal commits them together; an object store takes the requests in parallel) and the cutting of the
next shard; what it holds beyond the shard being cut is at most this many shards. 8, not 4: the LM's
stdlib (six shards) then has every shard in flight at the end of its read, none queued behind a 4 MiB
fsync (bench_data's prepare row, 21 paired rounds at load ~5: ratio 0.335 -> 0.398, prepare 121 -> 113 ms
median)."""
"""Target size of a shard: big enough that a request's latency is small beside its transfer, small
enough that a loader worker holds a few of them (its memory does not grow with the corpus)."""
FORMAT = "relaunch-shards/1"


class DatasetSource:
    """What a task hands prepare to commit: ``splits`` maps a split name to a callable returning an
    iterator of chunks (a chunk: field name -> array whose first dimension counts its samples; each
    field has one dtype and sample shape across the split); ``meta`` (JSON-able, e.g. the tokenizer)
    goes into the manifest; ``fresh_chunks``: each chunk is in memory of its own that the source never
    fills again, so the writer keeps it as handed, without a copy (default: the source may reuse a
    chunk's memory).

    ``source_key``: a deterministic key of everything the content depends on, either

    - a string, known before anything is built (cheap): a second prepare of the same source finds its
      version by it (a record beside the manifest) without building it again; or
    - a callable returning it, a key known only once the source is read (e.g. a hash of the bytes the
      chunks are made of, computed as they are read): prepare builds the chunks, writes the shards the
      store lacks and the manifest last, and a second prepare of the same source writes nothing because
      every shard and the manifest are content-addressed (found, not written). :attr:`source_key` calls
      it (reading the source when nothing has yet).
    """

    __slots__ = ("splits", "meta", "fresh_chunks", "_key")

    def __init__(self, splits: Mapping[str, Callable[[], Iterator[dict[str, np.ndarray]]]],
                 meta: dict[str, Any] | None = None, source_key: str | Callable[[], str] | None = None,
                 fresh_chunks: bool = False):
        self.splits, self.meta, self.fresh_chunks = splits, dict(meta or {}), fresh_chunks
        self._key = source_key

    @property
    def key_known_early(self) -> bool:
        """Whether the source key is known before the chunks are built (a string, or none)."""
        return not callable(self._key)

    @property
    def source_key(self) -> str | None:
        if callable(self._key):
            return self._key()
        return self._key

    def __repr__(self) -> str:
        return f"DatasetSource(splits={list(self.splits)}, key={'late' if callable(self._key) else self._key!r})"


@dataclass(frozen=True)
class Shard:
    key: str
    samples: int
    bytes: int
    digest: str  # xxh3-128, hex


@dataclass
class Manifest:
    """A committed dataset version."""

    version: str
    fields: list[dict[str, Any]]  # [{"name", "dtype", "shape"}]
    splits: dict[str, list[Shard]]
    meta: dict[str, Any]
    format: str = FORMAT

    @property
    def dtype(self) -> np.dtype:
        """The structured dtype of one sample (one row of a shard)."""
        return np.dtype([(f["name"], np.dtype(f["dtype"]), tuple(f["shape"])) for f in self.fields])

    def samples(self, split: str) -> int:
        return sum(s.samples for s in self.split(split))

    def split(self, split: str) -> list[Shard]:
        try:
            return self.splits[split]
        except KeyError:
            raise BadInput(f"dataset {self.version} has no split {split!r} (it has {', '.join(sorted(self.splits))})") from None

    def body(self) -> dict[str, Any]:
        return {"format": self.format, "fields": self.fields, "meta": self.meta,
                "splits": {name: [[s.key, s.samples, s.bytes, s.digest] for s in shards]
                           for name, shards in sorted(self.splits.items())}}

    def to_json(self) -> bytes:
        return json.dumps({"version": self.version, **self.body()}, indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> "Manifest":
        raw = json.loads(data)
        splits = {name: [Shard(str(k), int(n), int(b), str(d)) for k, n, b, d in shards]
                  for name, shards in raw["splits"].items()}
        return cls(raw["version"], raw["fields"], splits, raw.get("meta", {}), raw.get("format", FORMAT))


def content_version(body: dict[str, Any]) -> str:
    return "sha256-" + hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


def manifest_key(version: str) -> str:
    return f"{PREFIX}/{version}/MANIFEST.json"


def source_record_key(source_key: str) -> str:
    return f"{PREFIX}/sources/{hashlib.sha256(source_key.encode()).hexdigest()[:32]}.json"


def dataset_uri(store, version: str) -> str:
    """The URI of a version's folder, for MLflow params and logs."""
    return store.uri_for(f"{PREFIX}/{version}")


def shard_digest(data: bytes | memoryview) -> str:
    return xxhash.xxh3_128_hexdigest(data)


def put_shard(store, key: str, payload: memoryview) -> bool:
    """Write a content-addressed shard the store lacks (durable when this returns: on a filesystem
    its file and folder are fsync'd, so a manifest written after it never names a shard a crash can
    lose); False when the store held it (or another prepare wrote the same bytes first).

    ``write_if_absent``: a shard is written once, never replaced, and the file store's ``write_bytes``
    would hash the payload again for an etag nobody reads."""
    if store.exists(key):
        return False
    data = payload if getattr(store, "scheme", None) == "file" else payload.tobytes()  # a client's request body
    return bool(store.write_if_absent(key, data))


class DatasetWriter:
    """Cuts each split's samples into shards of about ``shard_bytes`` and writes each one the store
    does not hold yet (up to ``threads`` at once, each from a buffer of its own: a source may fill a
    chunk's memory again once :meth:`add` returns); :meth:`commit` waits for every shard, durable, and
    writes the manifest last.

    Raises:
        BadInput: a split without samples, a field whose dtype or sample shape changes, an object dtype.
    """

    def __init__(self, store, *, meta: dict[str, Any] | None = None, shard_bytes: int = SHARD_BYTES,
                 threads: int = WRITE_THREADS):
        self.store, self.meta, self.shard_bytes, self.threads = store, dict(meta or {}), shard_bytes, threads
        self._pool: ThreadPoolExecutor | None = None
        self._inflight: list[Future] = []
        self.fields: list[dict[str, Any]] | None = None
        self.splits: dict[str, list[Shard]] = {}
        self.written = 0  # shards this writer put (a store that held them already: 0)
        self._pending: dict[str, list[np.ndarray]] = {}
        self._pending_rows: dict[str, int] = {}
        self._dtype: np.dtype | None = None

    def _rows(self, split: str, chunk: Mapping[str, np.ndarray]) -> np.ndarray:
        arrays = {name: np.asarray(a) for name, a in chunk.items()}
        counts = {len(a) for a in arrays.values()}
        if len(counts) != 1:
            raise BadInput(f"dataset split {split!r}: the fields of one chunk count different samples ({sorted(counts)})")
        described = [{"name": name, "dtype": a.dtype.str, "shape": list(a.shape[1:])} for name, a in arrays.items()]
        for d, (name, a) in zip(described, arrays.items()):
            if a.dtype.hasobject:
                raise BadInput(f"dataset split {split!r} field {name!r}: object arrays cannot be stored safely")
        if self.fields is None:
            self.fields = described
            self._dtype = np.dtype([(f["name"], np.dtype(f["dtype"]), tuple(f["shape"])) for f in self.fields])
        elif described != self.fields:
            raise BadInput(f"dataset split {split!r}: a chunk's fields {described} differ from the first chunk's {self.fields}")
        dtype, n = self._dtype, counts.pop()
        if len(arrays) == 1:
            (a,) = arrays.values()
            if a.flags.c_contiguous and n:  # one field: its rows are the shard's rows already (no copy)
                return a.reshape(n, -1).view(dtype).reshape(n)
        rows = np.empty(n, dtype=dtype)
        for name, a in arrays.items():
            rows[name] = a
        return rows

    def add(self, split: str, chunk: Mapping[str, np.ndarray], *, fresh: bool = False) -> None:
        """Take ``chunk``'s samples (``fresh``: its memory is the writer's from now on, never filled
        again by the caller: kept without a copy)."""
        rows = self._rows(split, chunk)
        borrowed = not fresh and not rows.flags.owndata  # the caller's memory: it may fill it again after this call
        self.splits.setdefault(split, [])
        at = 0
        per_shard = max(1, self.shard_bytes // max(1, rows.dtype.itemsize))
        while at < len(rows):
            room = per_shard - self._pending_rows.get(split, 0)
            take = rows[at:at + room]
            full = self._pending_rows.get(split, 0) + len(take) == per_shard
            written_now = full and self.threads <= 1  # else the shard is written after this call returns
            self._pending.setdefault(split, []).append(take.copy() if borrowed and not written_now else take)
            self._pending_rows[split] = self._pending_rows.get(split, 0) + len(take)
            at += len(take)
            if full:
                self._flush(split)

    def _flush(self, split: str) -> None:
        parts = self._pending.pop(split, [])
        self._pending_rows[split] = 0
        if not parts:
            return
        rows = np.concatenate(parts) if len(parts) > 1 else parts[0]
        payload = memoryview(rows.view(np.uint8))  # the rows' bytes, not a copy of them
        digest = shard_digest(payload)
        key = f"{PREFIX}/shards/{digest}.bin"
        self.splits[split].append(Shard(key, len(rows), len(payload), digest))
        if self.threads <= 1:
            self.written += put_shard(self.store, key, payload)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="shard-writer")
        while len(self._inflight) >= self.threads:
            self.written += self._inflight.pop(0).result()
        self._inflight.append(self._pool.submit(put_shard, self.store, key, payload))

    def _wait(self) -> None:
        """Every shard submitted written (its error raised here, once the writes in flight ended)."""
        try:
            while self._inflight:
                self.written += self._inflight.pop(0).result()
        except BaseException:
            self.close()
            raise
        if self._pool is not None:  # every write returned: its idle threads end by themselves, not joined first
            self._pool.shutdown(wait=False)
            self._pool = None

    def close(self) -> None:
        """End the writing threads (waiting for the writes in flight); idempotent."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._inflight.clear()

    def commit(self, also: Callable[[Manifest], int] | None = None) -> Manifest:
        """Write the last shards and the manifest (unless the version is committed already); ``also``
        (what else names the version, e.g. a source record: read only with its manifest) is called
        with the manifest while the manifest is written, and the objects it wrote counted."""
        for split in list(self._pending):
            self._flush(split)
        self._wait()  # every shard durable before the manifest names it
        empty = [name for name, shards in self.splits.items() if not shards]
        if not self.splits or empty or self.fields is None:
            raise BadInput(f"dataset: the task built no samples for split(s) {', '.join(empty) or 'any'}; "
                           "check its data source")
        manifest = Manifest("", self.fields, self.splits, self.meta)
        manifest.version = content_version(manifest.body())
        if also is None:
            self._write_manifest(manifest)
            return manifest
        with ThreadPoolExecutor(1, thread_name_prefix="dataset-record") as pool:
            beside = pool.submit(also, manifest)  # its fsync overlaps the manifest's
            self._write_manifest(manifest)
            self.written += beside.result()
        return manifest

    def _write_manifest(self, manifest: Manifest) -> None:
        if not self.store.exists(manifest_key(manifest.version)):
            self.store.write_bytes(manifest_key(manifest.version), manifest.to_json())
            self.written += 1


def commit_source(store, source: DatasetSource, *, shard_bytes: int = SHARD_BYTES) -> tuple[Manifest, int]:
    """Commit ``source`` (or find the version it built before, by a ``source_key`` known early): the
    manifest and how many objects this call wrote (0 when the store held the dataset already: a shard
    or a manifest the store holds is never written again)."""
    early = source.key_known_early
    if early and source.source_key:
        found = version_of_source(store, source.source_key)
        if found is not None:
            return found, 0

    def record(manifest: Manifest) -> int:
        """The source's record, written with the manifest: a record whose manifest a crash lost is
        read as no record (:func:`version_of_source` checks the manifest is there). A key known only
        once the source is read has none: nothing could look it up before building (the shards and
        the manifest, content-addressed, are what a second prepare finds)."""
        body = json.dumps({"version": manifest.version, "source_key": source.source_key}).encode()
        return int(bool(store.write_if_absent(source_record_key(source.source_key), body)))

    writer = DatasetWriter(store, meta=source.meta, shard_bytes=shard_bytes)
    try:
        for split, chunks in source.splits.items():
            for chunk in chunks():
                writer.add(split, chunk, fresh=source.fresh_chunks)
            writer.splits.setdefault(split, [])
        manifest = writer.commit(also=record if early and source.source_key else None)
    finally:
        writer.close()
    return manifest, writer.written


def arrays_source(splits: Mapping[str, Mapping[str, np.ndarray]]) -> DatasetSource:
    """A task's whole arrays (``build_splits``) as a source: one chunk per split."""
    return DatasetSource({name: (lambda arrays=arrays: iter([dict(arrays)])) for name, arrays in splits.items()})


def version_of_source(store, source_key: str) -> Manifest | None:
    """The committed version a source built, when the store holds it whole (manifest included)."""
    key = source_record_key(source_key)
    if not store.exists(key):
        return None
    try:
        version = json.loads(store.read_bytes(key))["version"]
    except (ValueError, KeyError, TypeError):
        return None
    if not store.exists(manifest_key(version)):
        return None
    return read_manifest(store, version)


def read_manifest(store, version: str) -> Manifest:
    """The manifest of a committed version, its content address checked.

    Raises:
        BadInput: the version is not in this store.
        CorruptDataset: the manifest does not hash to its version.
    """
    key = manifest_key(version)
    if not store.exists(key):
        raise BadInput(f"data.version: {version!r} is not in the store {dataset_uri(store, version)!r}; "
                       "run the prepare step or unset data.version")
    raw = store.read_bytes(key)
    try:
        if json.loads(raw).get("format") == "npz":
            return _legacy_manifest(store, version, json.loads(raw))
        manifest = Manifest.from_json(raw)
    except (ValueError, KeyError, TypeError) as err:
        raise CorruptDataset(f"dataset {version}: MANIFEST.json cannot be read ({err}); "
                             f"delete {dataset_uri(store, version)} and run prepare again") from None
    if content_version(manifest.body()) != version:
        raise CorruptDataset(f"dataset {version}: MANIFEST.json does not hash to its version (damaged); "
                             f"delete {dataset_uri(store, version)} and run prepare again")
    return manifest


def read_shard(store, shard: Shard, dtype: np.dtype) -> np.ndarray:
    """A shard's rows, read whole and checked against its digest (read again once: a transfer can
    flip a bit that the store does not hold).

    Raises:
        CorruptDataset: the stored shard does not match its digest or its size.
    """
    for attempt in (1, 2):
        payload = store.read_bytes(shard.key)
        if len(payload) == shard.bytes and shard_digest(payload) == shard.digest:
            return np.frombuffer(payload, dtype=dtype)
    what = f"{len(payload)} bytes, not {shard.bytes}" if len(payload) != shard.bytes else "its digest does not match"
    raise CorruptDataset(f"dataset shard {store.uri_for(shard.key)} is damaged ({what}); delete it and run "
                         "prepare again: it writes every shard the store lacks")


def copy_dataset(source, target, version: str) -> int:
    """Commit ``version`` of the store ``source`` into ``target`` (a trial's folder): each shard the
    target lacks, read checked, then the manifest; the objects written (0 when it held them all)."""
    manifest = read_manifest(source, version)
    written = 0
    if manifest.format == "npz":
        keys = sorted({s.key.split("#", 1)[0] for shards in manifest.splits.values() for s in shards})
        for split in manifest.splits:
            read_legacy_split(source, manifest, split)  # checked
    else:
        keys = []
        for shards in manifest.splits.values():
            for shard in shards:
                if not target.exists(shard.key):
                    target.write_bytes(shard.key, read_shard(source, shard, manifest.dtype).tobytes())
                    written += 1
    for key in keys:
        if not target.exists(key):
            target.write_bytes(key, source.read_bytes(key))
            written += 1
    if not target.exists(manifest_key(version)):
        target.write_bytes(manifest_key(version), source.read_bytes(manifest_key(version)))
        written += 1
    return written


# ---------------------------------------------------------------------------- before shards: splits.npz


LEGACY_SHARD = "splits.npz"


def _legacy_manifest(store, version: str, raw: dict[str, Any]) -> Manifest:
    """A version stored as one ``splits.npz``: one pseudo-shard per split, read whole by
    :func:`read_legacy_split`."""
    splits: dict[str, list[Shard]] = {}
    fields: dict[str, dict[str, Any]] = {}
    for name, spec in raw["arrays"].items():
        split, key = name.split(".", 1)
        fields.setdefault(key, {"name": key, "dtype": spec["dtype"], "shape": spec["shape"][1:]})
        splits[split] = [Shard(f"{PREFIX}/{version}/{raw['file']}#{split}", int(spec["shape"][0]), int(raw["size"]),
                               raw["sha256"])]
    return Manifest(version, sorted(fields.values(), key=lambda f: f["name"]), splits, {}, "npz")


def read_legacy_split(store, manifest: Manifest, split: str) -> np.ndarray:
    shard = manifest.split(split)[0]
    payload = store.read_bytes(shard.key.split("#", 1)[0])
    if hashlib.sha256(payload).hexdigest() != shard.digest:
        raise CorruptDataset(f"dataset {manifest.version}: splits.npz does not match the sha256 in its MANIFEST.json")
    rows = np.empty(shard.samples, dtype=manifest.dtype)
    with np.load(io.BytesIO(payload), allow_pickle=False) as npz:
        for f in manifest.fields:
            rows[f["name"]] = npz[f"{split}.{f['name']}"]
    return rows


def iter_rows(store, manifest: Manifest, split: str) -> Iterable[np.ndarray]:
    """Each shard's rows of ``split`` in stored order, checked."""
    if manifest.format == "npz":
        yield read_legacy_split(store, manifest, split)
        return
    for shard in manifest.split(split):
        yield read_shard(store, shard, manifest.dtype)
