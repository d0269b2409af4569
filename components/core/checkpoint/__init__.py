"""Crash-consistent checkpoints on a filesystem or S3: save, commit, locate, load, retention.

One job per module: ``layout`` (names, manifest), ``dcp_io`` (DCP reader/writer over the Store),
``verify`` (digests, the O(1) check, the deep audit), ``lease`` (single writer), ``retention``,
``legacy_v1`` (reading format-1 checkpoints), ``snapshot`` (the CPU copy a save takes), ``start`` (where a
training starts) and ``manager``
(:class:`CheckpointManager`, which ties them together). The format is in docs/checkpoint-format.md.
Importing this package does not import torch; :class:`CheckpointManager` does, on first use.
"""

from typing import Any

from components.core.checkpoint.layout import (FORMAT_VERSION, INFLIGHT, LATEST, LEASE, MANIFEST, PINS, PREFIX,
                                               READABLE_VERSIONS, CheckpointInfo, checkpoint_steps,
                                               parse_checkpoint_uri, step_key)

__all__ = ["FORMAT_VERSION", "INFLIGHT", "LATEST", "LEASE", "MANIFEST", "PINS", "PREFIX", "READABLE_VERSIONS",
           "CheckpointInfo", "CheckpointManager", "checkpoint_steps", "parse_checkpoint_uri", "read_metadata",
           "step_key"]


def __getattr__(name: str) -> Any:
    if name == "CheckpointManager":
        from components.core.checkpoint.manager import CheckpointManager

        return CheckpointManager
    if name == "read_metadata":
        from components.core.checkpoint.legacy_v1 import read_metadata

        return read_metadata
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
