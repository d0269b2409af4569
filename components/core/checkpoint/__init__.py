"""Crash-consistent checkpoints on a filesystem or object store: save, commit, locate, load, retention.

One job per module, each a collaborator that owns its state and works alone on a store:

- ``manager``: :class:`CheckpointManager`, the one public class; it guards, then asks its collaborators,
  which it wires: ``ranks`` (:class:`Ranks`, the collectives of its own group), ``leases``
  (:class:`Leases`: the write lease's take, heartbeat and release; read leases; the claim before a
  deletion), ``locate`` (:class:`Locator`: latest, list, best, verify, pins; damage found),
  ``load`` (:class:`Loader`: formats 1, 2 and 3 read into a state; the fall-back to the previous
  checkpoint), ``retention`` (:class:`Retention`: what a commit keeps) and ``commit``
  (:class:`Committer`: snapshot, write, preflight, commit point, latest.json, retention).
- ``layout`` (names, manifest), ``dcp_io`` (DCP reader/writer over the Store), ``verify`` (digests,
  the O(1) check, the deep audit), ``snapshot`` (the CPU copy a save takes), ``fingerprint`` (which
  model a checkpoint holds).
- ``lease`` (the single writer's lease), ``readers`` (read leases, the deletion handshake),
  ``quarantine`` (records of damage, moving a damaged checkpoint aside).
- ``legacy_v1`` (reading format-1 checkpoints), ``interop`` (export and import), ``safe_pickle``
  (the restricted unpickler of DCP metadata), ``start`` (where a training starts: the one rule).

The format is in docs/checkpoint-format.md.
Importing this package does not import torch; :class:`CheckpointManager` does, on first use.
"""

from typing import Any

from .layout import (FORMAT_VERSION, INFLIGHT, LATEST, LEASE, MANIFEST, PINS, PREFIX,
                     READABLE_VERSIONS, CheckpointInfo, checkpoint_steps,
                     parse_checkpoint_uri, step_key)

__all__ = ["FORMAT_VERSION", "INFLIGHT", "LATEST", "LEASE", "MANIFEST", "PINS", "PREFIX", "READABLE_VERSIONS",
           "CheckpointInfo", "CheckpointManager", "checkpoint_steps", "parse_checkpoint_uri", "step_key"]


def __getattr__(name: str) -> Any:
    if name == "CheckpointManager":
        from .manager import CheckpointManager

        return CheckpointManager
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
