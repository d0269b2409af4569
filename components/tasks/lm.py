"""The language-model example: a small decoder-only transformer (GPT-2's shape, built from torch's own
modules) trained on the bytes of a text corpus every machine has, the Python standard library's source.

    relaunch run --config configs/lm.yaml

The tokenizer is byte-level and its tokens are bytes: the end-of-document token is the byte NUL (0),
which text does not hold; a NUL byte in a file (or a prompt) becomes SUB (0x1A, ASCII's "substitute":
a character found invalid), never an end of document. 256 tokens, stored as uint8. It is described in
the dataset's ``meta`` (``{"kind": "bytes", "vocab_size": 256, "eos": 0, "nul_as": 26}``), so it is
versioned with the data, and the task reads it from the dataset it trains on (``data.version``):
datasets prepared before (uint16 tokens, ``{"kind": "bytes", "vocab_size": 257, "eos": 256}``) still
train, evaluate and register, with a model of their vocabulary. A registered model carries its
tokenizer's description and serves with it. prepare commits the corpus as sequences of ``seq_len + 1``
tokens (the field ``tokens``): documents joined with the end-of-document token, cut into
non-overlapping windows, each file in train, val or test by a stable hash of its relative path.

Options (``train.task_options``, defaults in :attr:`LMTask.options`): the model's ``d_model``,
``n_layers``, ``n_heads``, ``seq_len`` and ``dropout``; the ``corpus`` and ``max_corpus_bytes``, the cap
on what is read of it; ``max_new_tokens``, the length of a served continuation. The corpus is ``stdlib``,
a folder, or a store URI (``s3://bucket/prefix``, ``gs://``, ``az://``, ``file://``: whatever ``store.uri``
accepts, credentials from the environment), of which the ``*.py``, ``*.txt`` and ``*.md`` files are read
(hidden folders and ``__pycache__`` left out), in sorted path order:

    relaunch run --config configs/lm.yaml --set train.task_options.corpus=s3://my-bucket/texts

prepare reads each file once: the same bytes make the tokens and the source key (an xxh3 of every file's
path, size and content), so a second prepare of the same files, in a folder or a bucket, writes nothing.

torch is imported by the methods that use it: prepare only builds the dataset, and a process that does
not train should not pay for importing torch.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import sys
import sysconfig
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterable, Iterator

import numpy as np
import xxhash

from relaunch.components.core.contract.config import RelaunchConfig
from relaunch.components.core.contract.errors import BadInput

from relaunch.components.core.data import DatasetSource
from relaunch.components.core.data.shards import SHARD_BYTES

if TYPE_CHECKING:
    import torch
    from torch import nn

NUL_AS = 0x1A
"""What a NUL byte of the text becomes (SUB, ASCII's substitute for an invalid character): NUL is the
end-of-document token."""


@dataclass(frozen=True)
class ByteTokenizer:
    """A byte-level tokenizer: a token per byte of the UTF-8 text, and ``eos``, the end of a document.

    Two are read: :data:`BYTES`, what prepare builds (the end of a document is the byte NUL, a NUL of
    the text becomes :data:`NUL_AS`; 256 tokens, uint8), and :data:`BYTES_EOS_256`, what it built
    before (the end of a document is a 257th token; uint16)."""

    vocab_size: int
    eos: int
    nul_as: int | None = None  # what a NUL byte becomes when NUL is ``eos``

    @property
    def dtype(self) -> np.dtype:
        """The stored tokens' dtype: the narrowest that holds the vocabulary."""
        return np.dtype(np.uint8 if self.vocab_size <= 256 else np.uint16)

    def describe(self) -> dict[str, Any]:
        """The description stored in a dataset's meta and a registered model's package."""
        d = {"kind": "bytes", "vocab_size": self.vocab_size, "eos": self.eos}
        return d if self.nul_as is None else {**d, "nul_as": self.nul_as}

    @classmethod
    def of(cls, description: Any, where: str) -> "ByteTokenizer":
        """The tokenizer a description (a dataset's ``meta["tokenizer"]``) names.

        Raises:
            BadInput: it is not one of the byte tokenizers this task reads.
        """
        for known in (BYTES, BYTES_EOS_256):
            if description == known.describe():
                return known
        raise BadInput(f"{where}: the tokenizer {description!r} is not one the LM task reads (it reads "
                       f"{BYTES.describe()} and {BYTES_EOS_256.describe()}); prepare the corpus again with "
                       f"this version (unset data.version)")

    def bytes_of(self, doc: np.ndarray) -> np.ndarray:
        """The tokens of a document's bytes (uint8), without an end-of-document token: ``doc`` itself
        unless it holds a NUL that this tokenizer maps (then a copy with each one :data:`NUL_AS`)."""
        if self.nul_as is None or not len(doc) or doc.min():
            return doc
        doc = doc.copy()
        doc[doc == 0] = self.nul_as
        return doc

    def encode(self, text: str | bytes) -> np.ndarray:
        """The tokens of ``text`` (UTF-8 bytes), :attr:`dtype`, without an end-of-document token; uint8
        tokens are a read-only view of the text's bytes (no copy), each NUL replaced first."""
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        if self.nul_as is not None:
            if b"\0" in data:  # memchr: the text holds a NUL (rarely)
                data = data.replace(b"\0", bytes([self.nul_as]))
            return np.frombuffer(data, dtype=np.uint8)
        return np.frombuffer(data, dtype=np.uint8).astype(self.dtype)

    def decode(self, tokens: Iterable[int] | np.ndarray) -> str:
        """The text of ``tokens``: end-of-document tokens skipped, bytes that are not UTF-8 replaced."""
        arr = np.asarray(tokens if isinstance(tokens, np.ndarray) else list(tokens), dtype=np.int64)
        keep = (arr >= 0) & (arr < 256) & (arr != self.eos)
        return arr[keep].astype(np.uint8).tobytes().decode("utf-8", errors="replace")


BYTES = ByteTokenizer(vocab_size=256, eos=0, nul_as=NUL_AS)
"""The tokenizer prepare builds: 256 byte tokens, the end of a document NUL (a NUL of the text SUB), uint8."""
BYTES_EOS_256 = ByteTokenizer(vocab_size=257, eos=256)
"""The tokenizer of datasets prepared before: 256 bytes and a 257th token ending a document, uint16."""
VOCAB_SIZE = BYTES.vocab_size
EOS = BYTES.eos
"""The end-of-document token: between documents in the corpus, and the context a prompt starts from."""
TOKENIZER = BYTES.describe()
CHUNK_SEQUENCES = 1024
"""Sequences per chunk :func:`sequences` yields by default (~132 KB of uint8 at seq_len 128)."""
CORPUS_SUFFIXES = (".py", ".txt", ".md")
"""The files read of a folder named as the corpus."""
STDLIB_SKIPPED = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"})
"""Folders of the standard library left out of the corpus: installed packages, test suites, IDLE."""
EVAL_BATCH = 64
"""Sequences per forward pass in :meth:`LMTask.evaluate`."""


# ---- the tokenizer prepare builds

def encode(text: str | bytes) -> np.ndarray:
    """The tokens of ``text`` (UTF-8 bytes), uint8 (a read-only view of them), without an end-of-document
    token; each NUL becomes :data:`NUL_AS` (:data:`BYTES`)."""
    return BYTES.encode(text)


def decode(tokens: Iterable[int] | np.ndarray) -> str:
    """The text of ``tokens``: end-of-document tokens skipped, bytes that are not UTF-8 replaced."""
    return BYTES.decode(tokens)


# ---- the corpus: which files, in which split, cut into sequences

def is_store_uri(corpus: str) -> bool:
    """Whether the ``corpus`` option names a store (``s3://``, ``gs://``, ``az://``, ``file://`` ...)."""
    return "://" in corpus


def corpus_root(corpus: str) -> Path:
    """The folder the ``corpus`` option names: ``stdlib``, the standard library of this interpreter.

    Raises:
        BadInput: ``corpus`` is neither ``stdlib`` nor an existing folder.
    """
    if corpus == "stdlib":
        return Path(sysconfig.get_paths()["stdlib"])
    root = Path(corpus).expanduser()
    if not root.is_dir():
        raise BadInput(f"train.task_options.corpus={corpus!r} is neither 'stdlib' nor an existing folder; "
                       f"name a folder of *.py, *.txt or *.md files, or a store URI (s3://bucket/prefix, "
                       f"gs://..., az://..., file:///path)")
    return root


def _walk(root: str, rel: str, skipped: frozenset[str], suffixes: tuple[str, ...],
          found: list[tuple[str, str, int]]) -> None:
    """Append ``(relative path, path, size)`` of the files under ``root/rel`` (one ``scandir`` a folder:
    its entries' types come with the listing; symlinked folders are not followed, as ``os.walk``)."""
    with os.scandir(os.path.join(root, rel) if rel else root) as entries:
        for entry in entries:
            name = entry.name
            if entry.is_dir() and not entry.is_symlink():
                if name not in skipped and not name.startswith("."):
                    _walk(root, f"{rel}{name}/", skipped, suffixes, found)
            elif name.endswith(suffixes) and entry.is_file():
                found.append((rel + name, entry.path, entry.stat().st_size))


def _capped(found: list[tuple[str, Any, int]], max_bytes: int) -> list[tuple[str, Any, int]]:
    """``found`` in sorted relative-path order, read up to ``max_bytes`` in all (the last file cut short;
    empty files left out)."""
    out, total = [], 0
    for rel, where, size in sorted(found, key=lambda f: f[0]):
        if total >= max_bytes:
            break
        size = min(size, max_bytes - total)
        if size:
            out.append((rel, where, size))
            total += size
    return out


def _listing(corpus: str, max_bytes: int) -> tuple[Path, list[tuple[str, str, int]]]:
    root = corpus_root(corpus)
    suffixes = (".py",) if corpus == "stdlib" else CORPUS_SUFFIXES
    skipped = STDLIB_SKIPPED if corpus == "stdlib" else frozenset({"__pycache__"})
    found: list[tuple[str, str, int]] = []
    _walk(str(root), "", skipped, suffixes, found)
    files = _capped(found, max_bytes)
    if not files:
        raise BadInput(f"train.task_options.corpus={corpus!r}: {root} holds no {', '.join(suffixes)} file to read")
    return root, files


def corpus_files(corpus: str, max_bytes: int) -> list[tuple[str, Path, int]]:
    """``[(relative path, path, bytes to read)]`` of the corpus folder in sorted relative-path order, read
    up to ``max_bytes`` in all (the last file cut short). Hidden folders are left out, and of the standard
    library installed packages, test suites and IDLE.

    Raises:
        BadInput: the corpus holds no file to read.
    """
    return [(rel, Path(path), size) for rel, path, size in _listing(corpus, max_bytes)[1]]


@dataclass(frozen=True)
class Corpus:
    """The corpus as read, each file once: its documents' bytes one after another in sorted
    relative-path order (``data``, uint8), document ``i`` being ``data[starts[i]:starts[i + 1]]``."""

    root: str  # the folder or the store URI
    names: list[str]  # each document's path relative to the root
    starts: np.ndarray  # int64, len(names) + 1
    data: np.ndarray

    def doc(self, i: int) -> np.ndarray:
        return self.data[self.starts[i]:self.starts[i + 1]]

    def size(self, i: int) -> int:
        return int(self.starts[i + 1] - self.starts[i])

    def key(self, key_header: bytes) -> str:
        """The source key's digest (hex): an xxh3 of ``key_header`` then each document's relative path,
        size and bytes, in order (what :class:`SplitReader` hashes as it reads a folder)."""
        h = xxhash.xxh3_128(key_header)
        for i, rel in enumerate(self.names):
            h.update(f"{rel}\0{self.size(i)}\0".encode())
            h.update(self.doc(i))
        return h.hexdigest()


def _folder_corpus(corpus: str, max_bytes: int) -> Corpus:
    """A folder's files (the standard library's), each read once into one buffer (``readinto``: no
    copy of its bytes)."""
    root, files = _listing(corpus, max_bytes)
    starts = np.zeros(len(files) + 1, dtype=np.int64)
    np.cumsum([size for _, _, size in files], out=starts[1:])
    data = np.empty(int(starts[-1]), dtype=np.uint8)
    view = memoryview(data)
    for i, (_, path, _) in enumerate(files):
        _read_into(view[int(starts[i]):int(starts[i + 1])], path, corpus)
    return Corpus(str(root), [rel for rel, _, _ in files], starts, data)


def _read_into(view: memoryview, path: str, corpus: str) -> None:
    """Fill ``view`` with the first bytes of the file at ``path`` (``readinto``: no copy).

    Raises:
        BadInput: the file is shorter than ``view`` (it shrank since it was listed).
    """
    at, end = 0, len(view)
    with open(path, "rb", buffering=0) as fh:
        while at < end:
            n = fh.readinto(view[at:end])
            if not n:
                raise BadInput(f"train.task_options.corpus={corpus!r}: {path} changed while prepare read it; "
                               "run prepare again")
            at += n


READ_NOTIFY_BYTES = 256 << 10
"""How much :class:`SplitReader` reads between two wake-ups of whoever waits for its sequences."""


class SplitReader:
    """A folder's documents read on a thread of their own, each file once, straight into its place in
    its split's sequences: one buffer holds each split's documents in order, each followed by the
    end-of-document token, so a chunk of :func:`windows` is a slice of it (no copy) that
    :meth:`sequences` hands out as soon as its bytes are read. Cutting and writing the first shards
    overlaps reading the rest. The source key is hashed from the same bytes as they are read, in
    sorted path order (:meth:`Corpus.key`'s digest of the same files); a NUL of the text is made
    :data:`NUL_AS` after it is hashed.

    ``files``: ``(relative path, path, size)`` in sorted relative-path order; ``split_of_file``: each
    one's split. The thread starts with the first sequences or key asked for.
    """

    def __init__(self, files: list[tuple[str, str, int]], split_of_file: list[str], seq_len: int,
                 key_header: bytes, corpus: str, tokenizer: ByteTokenizer = BYTES):
        if tokenizer.dtype != np.uint8:
            raise ValueError("SplitReader lays out uint8 tokens: bytes are their own tokens")
        self.files, self.seq_len, self.tokenizer = files, seq_len, tokenizer
        self._header, self._corpus = key_header, corpus
        self.regions: dict[str, tuple[int, int]] = {}
        self._slot = [0] * len(files)  # where each file's bytes go
        at = 0
        for split in dict.fromkeys(split_of_file):
            begin = at
            for i, (_, _, size) in enumerate(files):
                if split_of_file[i] == split:
                    self._slot[i] = at
                    at += size + 1  # its bytes, then the end-of-document token
            self.regions[split] = (begin, at)
        self._split = split_of_file
        self.buffer = np.empty(at, dtype=np.uint8)
        self._filled = {split: begin for split, (begin, _) in self.regions.items()}  # each split's read front
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._finished = False
        self._error: BaseException | None = None
        self._key: str | None = None
        self._published = 0  # files whose bytes the split fronts cover

    def sequences(self, split: str, chunk: int | None = None) -> Iterator[dict[str, np.ndarray]]:
        """:func:`windows` of the split's documents: chunks ``{"tokens": [n, seq_len + 1]}`` of ``chunk``
        rows (default :func:`shard_rows`) but the last, each a slice of the buffer (never filled again),
        each handed out as soon as it is read.

        Raises:
            BadInput: a file changed while it was read.
        """
        width = self.seq_len + 1
        step = (chunk or shard_rows(self.seq_len, self.tokenizer)) * width
        at, end = self.regions.get(split, (0, 0))
        whole = end - (end - at) % width  # the tail shorter than a window is dropped
        while at < whole:
            upto = min(at + step, whole)
            self._wait(lambda: self._filled[split] >= upto)
            yield {"tokens": self.buffer[at:upto].reshape(-1, width)}
            at = upto

    def key(self) -> str:
        """The source key's digest (hex), once every file is read (read now when nothing asked before).

        Raises:
            BadInput: a file changed while it was read.
        """
        self._wait(lambda: False)
        if self._error is not None:
            raise self._error
        assert self._key is not None
        return self._key

    def _wait(self, ready: Callable[[], bool]) -> None:
        with self._cond:
            if self._thread is None and not self._finished:
                self._thread = threading.Thread(target=self._run, name="corpus-reader", daemon=True)
                self._thread.start()
            while not self._finished and not ready():
                self._cond.wait()
            if not ready() and self._error is not None:
                raise self._error

    def _run(self) -> None:
        """Read each file into its slot, hash it, make its NULs :data:`NUL_AS`, put its end-of-document
        token; tell the waiting side every :data:`READ_NOTIFY_BYTES` (file reads and the hash release
        the GIL)."""
        h = xxhash.xxh3_128(self._header)
        view, eos, nul_as = memoryview(self.buffer), self.tokenizer.eos, self.tokenizer.nul_as
        unannounced = 0
        try:
            for i, (rel, path, size) in enumerate(self.files):
                at = self._slot[i]
                _read_into(view[at:at + size], path, self._corpus)
                h.update(f"{rel}\0{size}\0".encode())
                h.update(view[at:at + size])
                doc = self.buffer[at:at + size]
                if nul_as is not None and size and not doc.all():
                    doc[doc == 0] = nul_as
                self.buffer[at + size] = eos
                unannounced += size
                if unannounced >= READ_NOTIFY_BYTES or i == len(self.files) - 1:
                    with self._cond:
                        self._publish(i)
                        self._cond.notify_all()
                    unannounced = 0
            self._key = h.hexdigest()
        except BaseException as err:  # handed to whoever waits for sequences or the key
            self._error = err
        finally:
            with self._cond:
                self._finished = True
                self._cond.notify_all()

    def _publish(self, last: int) -> None:
        """Advance each split's read front over the files up to ``last`` (each split's files are read
        in its order, so its front only moves forward)."""
        for i in range(self._published, last + 1):
            split, size = self._split[i], self.files[i][2]
            self._filled[split] = self._slot[i] + size + 1
        self._published = last + 1


def _store_corpus(uri: str, max_bytes: int) -> Corpus:
    """The ``*.py``, ``*.txt`` and ``*.md`` objects under a store URI (credentials from the environment,
    as for ``store.uri``), hidden folders and ``__pycache__`` left out, read through the store in sorted
    key order up to ``max_bytes`` (the last one cut short).

    Raises:
        BadInput: the URI is malformed, its bucket or container does not exist or refuses the
            credentials, or nothing under it is a file to read.
    """
    from relaunch.components.core.store import open_store

    where = f"train.task_options.corpus={uri!r}"
    try:
        store = open_store(uri)
        keys = store.list("", recursive=True)
    except BadInput as err:
        raise BadInput(f"{where}: {err}") from None
    found = [(key, key, -1) for key in keys if key.endswith(CORPUS_SUFFIXES)
             and not any(part.startswith(".") or part == "__pycache__" for part in key.split("/"))]
    names, parts, total = [], [], 0
    for key, _, _ in sorted(found):
        if total >= max_bytes:
            break
        try:
            data = store.read_bytes(key)[:max_bytes - total]
        except FileNotFoundError:  # deleted since the listing: not part of this corpus
            continue
        if data:
            names.append(key)
            parts.append(data)
            total += len(data)
    if not names:
        raise BadInput(f"{where}: no {', '.join(CORPUS_SUFFIXES)} file under it to read ({len(keys)} object(s) "
                       f"there); put the corpus's text files under that prefix or fix the URI")
    starts = np.zeros(len(names) + 1, dtype=np.int64)
    np.cumsum([len(d) for d in parts], out=starts[1:])
    return Corpus(uri, names, starts, np.frombuffer(b"".join(parts), dtype=np.uint8))


def read_corpus(corpus: str, max_bytes: int) -> Corpus:
    """The documents the ``corpus`` option names (``stdlib``, a folder or a store URI), each read once,
    up to ``max_bytes`` in all (prepare reads a folder through :class:`SplitReader` instead).

    Raises:
        BadInput: the corpus is missing, cannot be read, or holds no file to read.
    """
    return _store_corpus(corpus, max_bytes) if is_store_uri(corpus) else _folder_corpus(corpus, max_bytes)


def split_of(rel: str, val_fraction: float, test_fraction: float, seed: int) -> str:
    """``train``, ``val`` or ``test``: where the file at relative path ``rel`` goes, by a stable hash of
    ``seed`` and the path (the same on every machine and Python)."""
    u = int.from_bytes(hashlib.sha256(f"{seed}:{rel}".encode()).digest()[:8], "big") / 2.0**64
    return "test" if u < test_fraction else "val" if u < test_fraction + val_fraction else "train"


def shard_rows(seq_len: int, tokenizer: ByteTokenizer = BYTES) -> int:
    """Sequences of ``seq_len + 1`` tokens in one shard of the store's default size: the chunk a
    split's iterator yields, so each chunk is one shard, written from the chunk's own memory."""
    return max(1, SHARD_BYTES // (tokenizer.dtype.itemsize * (seq_len + 1)))


def windows(docs: Iterable[np.ndarray], seq_len: int, chunk: int | None = None,
            tokenizer: ByteTokenizer = BYTES) -> Iterator[dict[str, np.ndarray]]:
    """Chunks ``{"tokens": [n, seq_len + 1]}`` (the tokenizer's dtype) of the documents ``docs`` (their
    bytes, uint8), joined with the end-of-document token and cut into non-overlapping windows, in
    order; the tail shorter than a window is dropped. Every chunk has ``chunk`` rows (default
    :func:`shard_rows`) but the last, each in a buffer of its own (never filled again). numpy over whole documents: a document's bytes are its tokens
    (:meth:`ByteTokenizer.bytes_of`), copied into the chunk."""
    width = seq_len + 1
    chunk = chunk or shard_rows(seq_len, tokenizer)
    eos, dtype = tokenizer.eos, tokenizer.dtype
    buf, pos = np.empty(chunk * width, dtype=dtype), 0
    for doc in docs:
        doc = tokenizer.bytes_of(doc)
        at = 0
        while at <= len(doc):  # the document's bytes, then its end-of-document token, across chunks
            n = min(len(doc) - at, len(buf) - pos)
            buf[pos:pos + n] = doc[at:at + n]
            pos, at = pos + n, at + n
            if at == len(doc) and pos < len(buf):
                buf[pos] = eos
                pos, at = pos + 1, at + 1
            if pos == len(buf):
                yield {"tokens": buf.reshape(chunk, width)}
                buf, pos = np.empty(chunk * width, dtype=dtype), 0
    if pos >= width:
        yield {"tokens": buf[:pos - pos % width].reshape(-1, width)}


def sequences(paths: Iterable[tuple[Path, int]], seq_len: int, chunk: int = CHUNK_SEQUENCES,
              tokenizer: ByteTokenizer = BYTES) -> Iterator[dict[str, np.ndarray]]:
    """:func:`windows` of the documents at ``paths`` (each read up to its size)."""

    def docs() -> Iterator[np.ndarray]:
        for path, size in paths:
            with path.open("rb") as fh:
                yield np.frombuffer(fh.read(size), dtype=np.uint8)

    return windows(docs(), seq_len, chunk, tokenizer)


# ---- the model

@functools.cache
def _model_classes() -> tuple[type, type]:
    """The transformer's classes, defined on first use (torch is imported by what trains)."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    class Block(nn.Module):
        """Pre-norm causal self-attention and a GELU MLP, each around a residual."""

        def __init__(self, d_model: int, n_heads: int, dropout: float):
            super().__init__()
            self.n_heads, self.dropout = n_heads, dropout
            self.ln1 = nn.LayerNorm(d_model)
            self.qkv = nn.Linear(d_model, 3 * d_model)
            self.proj = nn.Linear(d_model, d_model)
            self.ln2 = nn.LayerNorm(d_model)
            self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))
            self.drop = nn.Dropout(dropout)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                               dropout_p=self.dropout if self.training else 0.0)
            x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, t, d)))
            return x + self.drop(self.mlp(self.ln2(x)))

    class DecoderLM(nn.Module):
        """Token and learned position embeddings, ``n_layers`` blocks, a final LayerNorm, and an output
        head whose weight is the token embedding's (tied)."""

        def __init__(self, vocab_size: int, seq_len: int, d_model: int, n_layers: int, n_heads: int,
                     dropout: float):
            super().__init__()
            self.seq_len = seq_len
            self.tok_emb = nn.Embedding(vocab_size, d_model)
            self.pos_emb = nn.Embedding(seq_len, d_model)
            self.drop = nn.Dropout(dropout)
            self.blocks = nn.ModuleList(Block(d_model, n_heads, dropout) for _ in range(n_layers))
            self.ln_f = nn.LayerNorm(d_model)
            self.head = nn.Linear(d_model, vocab_size, bias=False)
            self.head.weight = self.tok_emb.weight
            for name, p in self.named_parameters():  # GPT-2's initialisation
                if name.endswith("bias"):
                    nn.init.zeros_(p)
                elif p.dim() >= 2:
                    std = 0.02 / math.sqrt(2 * n_layers) if name.endswith(("proj.weight", "mlp.2.weight")) else 0.02
                    nn.init.normal_(p, mean=0.0, std=std)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            """Logits ``[b, t, vocab]`` of the next token at each position of ``tokens`` ``[b, t]``."""
            t = tokens.shape[1]
            if t > self.seq_len:
                raise ValueError(f"{t} tokens exceed the model's context of {self.seq_len}")
            pos = torch.arange(t, device=tokens.device)
            x = self.drop(self.tok_emb(tokens) + self.pos_emb(pos))
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln_f(x))

    return Block, DecoderLM


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _texts(inputs: Any, what: str) -> list[str]:
    """The strings of ``inputs``: a list of strings, a pandas DataFrame (its ``prompt`` column, or its only
    column) or Series, a numpy array, or one string.

    Raises:
        BadInput: ``inputs`` is none of these, or holds something that is not a string.
    """
    if isinstance(inputs, str):
        inputs = [inputs]
    elif hasattr(inputs, "columns"):  # a pandas DataFrame
        columns = list(inputs.columns)
        if "prompt" in columns:
            inputs = inputs["prompt"]
        elif len(columns) == 1:
            inputs = inputs[columns[0]]
        else:
            raise BadInput(f"{what}: a DataFrame needs a 'prompt' column (or exactly one column); got {columns}")
    if hasattr(inputs, "tolist"):  # a pandas Series, a numpy array
        inputs = inputs.tolist()
    if not isinstance(inputs, (list, tuple)):
        raise BadInput(f"{what}: give a list of strings (or a DataFrame with a 'prompt' column); "
                       f"got {type(inputs).__name__}")
    odd = next((s for s in inputs if not isinstance(s, str)), None)
    if odd is not None:
        raise BadInput(f"{what}: give a list of strings (or a DataFrame with a 'prompt' column); "
                       f"got a list holding {type(odd).__name__} {odd!r:.40}")
    return list(inputs)


# ---- the task

@dataclass
class LMTask:
    """A byte-level decoder-only transformer, AdamW with linear warm-up then cosine decay."""

    config: RelaunchConfig

    options: ClassVar[dict[str, Any]] = {
        "d_model": 128, "n_layers": 2, "n_heads": 4, "seq_len": 128, "dropout": 0.0,
        "corpus": "stdlib", "max_corpus_bytes": 4_000_000, "max_new_tokens": 32,
    }

    def __post_init__(self) -> None:
        o = {**self.options, **self.config.train.task_options}
        for name in ("d_model", "n_layers", "n_heads", "seq_len", "max_corpus_bytes", "max_new_tokens"):
            if not isinstance(o[name], int) or isinstance(o[name], bool) or o[name] < 1:
                raise BadInput(f"train.task_options.{name}={o[name]!r} must be a whole number >= 1")
        if o["d_model"] % o["n_heads"]:
            raise BadInput(f"train.task_options.d_model={o['d_model']} must be divisible by "
                           f"n_heads={o['n_heads']}")
        if o["seq_len"] >= 1 << 16:
            raise BadInput(f"train.task_options.seq_len={o['seq_len']} must be below 65536")
        if not isinstance(o["dropout"], (int, float)) or not 0 <= o["dropout"] < 1:
            raise BadInput(f"train.task_options.dropout={o['dropout']!r} must be a number in [0, 1)")
        if not isinstance(o["corpus"], str) or not o["corpus"]:
            raise BadInput(f"train.task_options.corpus={o['corpus']!r} must be 'stdlib', a folder path or a store URI")
        self.o = o
        self._tokenizer: ByteTokenizer | None = None

    # -- the tokenizer: the dataset's

    @property
    def tokenizer(self) -> ByteTokenizer:
        """The tokenizer of the data this task's model is for: the one a registered model's package
        names (:meth:`use_package_meta`), else the meta of the dataset ``data.version`` names, else
        the one prepare builds (:data:`BYTES`: the dataset is built by this version).

        Raises:
            BadInput: the dataset's meta names no tokenizer this task reads.
        """
        if self._tokenizer is None:
            version = self.config.data.version
            if version is None:
                self._tokenizer = BYTES
            else:
                from relaunch.components.core.data.shards import read_manifest
                from relaunch.components.core.store import open_store

                meta = read_manifest(open_store(self.config.store.uri), version).meta
                self._tokenizer = ByteTokenizer.of(meta.get("tokenizer"), f"data.version={version}")
        return self._tokenizer

    def package_meta(self) -> dict[str, Any]:
        """What a registered model's package keeps beside its weights: the tokenizer's description."""
        return {"tokenizer": self.tokenizer.describe()}

    def use_package_meta(self, meta: dict[str, Any]) -> None:
        """Serve with the tokenizer a package names (its model's), not the store's."""
        self._tokenizer = ByteTokenizer.of(meta.get("tokenizer"), "the registered model's package")

    # -- data

    def build_dataset(self) -> DatasetSource:
        """The corpus's train/val/test sequences, the tokenizer in ``meta``, and a ``source_key`` of what
        they depend on (every file's path and digest, the tokenizer, seq_len, the split rule).

        Raises:
            BadInput: the corpus is missing or empty, or too small for a split to hold one sequence.
        """
        o, d = self.o, self.config.data
        seq_len = o["seq_len"]
        split_rule = {"hash": "sha256(f'{split_seed}:{relative path}')", "val_fraction": d.val_fraction,
                      "test_fraction": d.test_fraction, "split_seed": d.split_seed}
        key_header = repr((BYTES.describe(), seq_len, split_rule)).encode()
        corpus: Corpus | None = None
        files: list[tuple[str, str, int]] = []
        if is_store_uri(o["corpus"]):  # read whole now (a store lists no sizes)
            corpus = read_corpus(o["corpus"], o["max_corpus_bytes"])
            root, names, sizes = corpus.root, corpus.names, [corpus.size(i) for i in range(len(corpus.names))]
        else:  # listed now, read as its sequences are cut
            folder, files = _listing(o["corpus"], o["max_corpus_bytes"])
            root, names, sizes = str(folder), [rel for rel, _, _ in files], [size for _, _, size in files]
        split_of_file = [split_of(rel, d.val_fraction, d.test_fraction, d.split_seed) for rel in names]
        documents = {name: split_of_file.count(name) for name in ("train", "val", "test")}
        for name in documents:
            tokens = sum(size + 1 for size, s in zip(sizes, split_of_file) if s == name)
            if tokens < seq_len + 1:
                raise BadInput(f"train.task_options: the {name} split of corpus={o['corpus']!r} holds {tokens} "
                               f"tokens, fewer than one sequence of seq_len+1={seq_len + 1}; raise "
                               f"max_corpus_bytes (now {o['max_corpus_bytes']}) or data.{name}_fraction")
        meta = {
            "tokenizer": BYTES.describe(), "seq_len": seq_len,
            "corpus": {"name": o["corpus"], "root": root, "files": len(names), "bytes": sum(sizes),
                       "max_corpus_bytes": o["max_corpus_bytes"],
                       "python": sys.version.split()[0] if o["corpus"] == "stdlib" else None},
            "split": split_rule,
            "documents": documents,
        }
        if corpus is not None:
            by_split = {name: [i for i, s in enumerate(split_of_file) if s == name] for name in documents}
            splits = {name: functools.partial(lambda c, docs: windows((c.doc(i) for i in docs), seq_len), corpus, docs)
                      for name, docs in by_split.items()}
            return DatasetSource(splits=splits, meta=meta, source_key=f"lm-bytes-xxh3-{corpus.key(key_header)}",
                                 fresh_chunks=True)  # windows() cuts each chunk into a buffer of its own
        reader = SplitReader(files, split_of_file, seq_len, key_header, o["corpus"])
        # each chunk a slice of the reader's buffer, never filled again; the key is known once every file
        # is read: a second prepare finds every shard and the manifest by their content (writes nothing)
        return DatasetSource(splits={name: functools.partial(reader.sequences, name) for name in documents},
                             meta=meta, source_key=lambda: f"lm-bytes-xxh3-{reader.key()}", fresh_chunks=True)

    # -- model and optimisation

    def build_model(self) -> nn.Module:
        o = self.o
        _, DecoderLM = _model_classes()
        return DecoderLM(self.tokenizer.vocab_size, o["seq_len"], o["d_model"], o["n_layers"], o["n_heads"], float(o["dropout"]))

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """AdamW, ``train.weight_decay`` on the matrices (the linears and the embeddings, the tied head
        with them), none on biases and LayerNorms."""
        import torch

        t = self.config.train
        decay = [p for p in model.parameters() if p.dim() >= 2]
        other = [p for p in model.parameters() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": other, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=t.lr, betas=(0.9, 0.95))

    def build_scheduler(self, optimizer: torch.optim.Optimizer, total_steps: int):
        """Linear warm-up over the first 5% of the steps, then cosine decay to a tenth of the peak."""
        import torch

        total = max(1, total_steps)
        warmup = max(1, total // 20)

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

        return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)

    def shard_blocks(self, model: nn.Module) -> list[nn.Module]:
        """The transformer's blocks, sharded one by one; the embeddings, the final norm and the tied head
        stay with the root."""
        return list(model.blocks)

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Mean next-token cross-entropy over every position of ``batch["tokens"]`` ``[b, seq_len + 1]``."""
        from torch.nn.functional import cross_entropy

        tokens = batch["tokens"].long()
        logits = model(tokens[:, :-1])
        return cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))

    # -- evaluation and serving

    def evaluate(self, model: nn.Module, split) -> dict[str, float]:
        """``loss`` (mean token cross-entropy), ``perplexity`` (its exp) and ``token_accuracy`` (the
        next-token argmax's) over every sequence of ``split``, streamed in batches."""
        import torch
        from torch.nn.functional import cross_entropy

        was_training = model.training
        model.eval()
        total, correct, count = 0.0, 0, 0
        device = _device(model)
        try:
            with torch.no_grad():
                for batch in split.batches(EVAL_BATCH):
                    tokens = torch.as_tensor(batch["tokens"]).long().to(device)
                    logits = model(tokens[:, :-1]).float()
                    target = tokens[:, 1:]
                    total += float(cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                                 reduction="sum"))
                    correct += int((logits.argmax(-1) == target).sum())
                    count += target.numel()
        finally:
            model.train(was_training)
        if not count:
            raise BadInput("evaluate: the split holds no sequence")
        loss = total / count
        return {"loss": loss, "perplexity": math.exp(loss) if loss < 700 else math.inf,
                "token_accuracy": correct / count}

    def serve(self, model: nn.Module, inputs: Any) -> list[str]:
        """The greedy continuation (up to ``max_new_tokens`` bytes, ending early at an end-of-document
        token) of each prompt in ``inputs``: a list of strings, a DataFrame with a ``prompt`` column, or a
        Series. Each prompt starts after an end-of-document token, as a document does in training; the
        tokens are the task's :attr:`tokenizer`'s (the model's)."""
        import torch

        prompts = _texts(inputs, "serve")
        was_training = model.training
        model.eval()
        device, seq_len, outputs, tok = _device(model), self.o["seq_len"], [], self.tokenizer
        try:
            with torch.no_grad():
                for prompt in prompts:
                    context = torch.from_numpy(np.concatenate([[tok.eos], tok.encode(prompt)]).astype(np.int64)).to(device)
                    new: list[int] = []
                    for _ in range(self.o["max_new_tokens"]):
                        token = int(model(context[-seq_len:][None])[0, -1].argmax())
                        if token == tok.eos:
                            break
                        new.append(token)
                        context = torch.cat([context, context.new_tensor([token])])
                    outputs.append(tok.decode(new))
        finally:
            model.train(was_training)
        return outputs

    def example_input(self) -> list[str]:
        """What the registered model's signature is inferred from."""
        return ["def fibonacci(n):\n", "import os\n"]

    def score(self, model: nn.Module, texts: Any) -> list[float]:
        """The mean token cross-entropy of each text (NaN for an empty one), each read after an
        end-of-document token, in windows of ``seq_len`` predictions."""
        import torch
        from torch.nn.functional import cross_entropy

        was_training = model.training
        model.eval()
        device, seq_len, scores, tok = _device(model), self.o["seq_len"], [], self.tokenizer
        try:
            with torch.no_grad():
                for text in _texts(texts, "score"):
                    tokens = torch.from_numpy(np.concatenate([[tok.eos], tok.encode(text)]).astype(np.int64)).to(device)
                    n = len(tokens) - 1
                    total = 0.0
                    for start in range(0, n, seq_len):
                        window = tokens[start:start + seq_len + 1]
                        logits = model(window[None, :-1])[0].float()
                        total += float(cross_entropy(logits, window[1:], reduction="sum"))
                    scores.append(total / n if n else math.nan)
        finally:
            model.train(was_training)
        return scores


def make_task(config: RelaunchConfig) -> LMTask:
    """Factory named by ``train.task: relaunch.components.tasks.lm:make_task``."""
    return LMTask(config)
