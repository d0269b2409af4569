"""Crash-consistent checkpoints on a filesystem or S3: save, commit, locate, load, retention.

One job per module:

- ``manager``: :class:`CheckpointManager`, the one public class; it guards, then calls its jobs:
  ``commit`` (the save job: snapshot, write, preflight, commit point, latest.json, retention),
  ``load`` (formats 1, 2 and 3 read into a state; the fall-back to the previous checkpoint),
  ``locate`` (latest, list, best, verify, pins; quarantine bookkeeping) and ``leases`` (the write
  lease's take, heartbeat and release; read leases; the claim before a deletion).
- ``layout`` (names, manifest), ``dcp_io`` (DCP reader/writer over the Store), ``verify`` (digests,
  the O(1) check, the deep audit), ``snapshot`` (the CPU copy a save takes).
- ``lease`` (the single writer's lease), ``readers`` (read leases, the deletion handshake),
  ``retention``, ``quarantine`` (records of damage, moving a damaged checkpoint aside).
- ``legacy_v1`` (reading format-1 checkpoints), ``interop`` (export and import), ``safe_pickle``
  (the restricted unpickler of DCP metadata), ``start`` (where a training starts).

The format is in docs/checkpoint-format.md.
Importing this package does not import torch; :class:`CheckpointManager` does, on first use.
"""

from typing import Any

from components.core.checkpoint.layout import (FORMAT_VERSION, INFLIGHT, LATEST, LEASE, MANIFEST, PINS, PREFIX,
                                               READABLE_VERSIONS, CheckpointInfo, checkpoint_steps,
                                               parse_checkpoint_uri, step_key)

__all__ = ["FORMAT_VERSION", "INFLIGHT", "LATEST", "LEASE", "MANIFEST", "PINS", "PREFIX", "READABLE_VERSIONS",
           "CheckpointInfo", "CheckpointManager", "checkpoint_steps", "parse_checkpoint_uri", "step_key"]


def __getattr__(name: str) -> Any:
    if name == "CheckpointManager":
        from components.core.checkpoint.manager import CheckpointManager

        return CheckpointManager
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
