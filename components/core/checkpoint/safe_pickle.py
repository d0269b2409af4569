"""A restricted unpickler for DCP's ``.metadata`` file, the one pickle relaunch ever reads.

``torch.distributed.checkpoint`` stores its metadata as a Python pickle. A checkpoint on shared
storage can be written by anyone with write access to it, so loading it with ``pickle.load`` would
run whatever code the file names. :func:`load_metadata` admits only DCP's own metadata dataclasses,
``torch.Size``, torch dtypes and layouts, ``pathlib`` paths and builtin containers; anything else
raises :class:`~relaunch.components.core.contract.errors.CorruptCheckpoint` before a single object is built.
"""

from __future__ import annotations

import io
import pickle
from typing import IO, Any

from ..contract.errors import CorruptCheckpoint

_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem",
                "torch.distributed.checkpoint.planner", "torch.distributed.checkpoint._extension")

_ALLOWED: dict[tuple[str, str], None] = dict.fromkeys([
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "Path"),
    ("collections", "OrderedDict"), ("collections", "defaultdict"),
    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "dict"), ("builtins", "list"),
    ("builtins", "tuple"), ("builtins", "int"), ("builtins", "float"), ("builtins", "str"),
    ("builtins", "bytes"), ("builtins", "bool"), ("builtins", "complex"),
])


class SafeUnpickler(pickle.Unpickler):
    """Resolves only the globals DCP metadata needs; refuses everything else by name."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module in _DCP_MODULES and not name.startswith("__"):
            obj = super().find_class(module, name)
            if isinstance(obj, type):  # dataclasses and enums only, never a function
                return obj
        if module == "torch":
            import torch

            obj = getattr(torch, name, None)
            if isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
                return obj
        raise CorruptCheckpoint(
            f"unsafe checkpoint metadata: it references {module}.{name}, which is not a DCP metadata "
            f"type; refusing to load it (a tampered or foreign checkpoint?)")


def load_metadata(fh: IO[bytes] | bytes, *, source: str = "checkpoint metadata") -> Any:
    """Unpickle DCP metadata from a file object or bytes with :class:`SafeUnpickler`.

    Raises:
        CorruptCheckpoint: the pickle names a non-admitted global, or is truncated/garbage.
    """
    if isinstance(fh, (bytes, bytearray)):
        fh = io.BytesIO(fh)
    try:
        return SafeUnpickler(fh).load()
    except CorruptCheckpoint as err:
        raise CorruptCheckpoint(f"{source}: {err}") from None
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, TypeError, ValueError,
            IndexError, KeyError) as err:
        raise CorruptCheckpoint(f"{source}: not a valid DCP metadata pickle ({type(err).__name__}: {err})") from None
