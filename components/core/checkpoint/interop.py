"""Checkpoints other tools can read and write (docs/checkpoint-format.md, "Other tools").

- :func:`export_checkpoint`: one committed checkpoint (any format version) as a single ``torch.save``
  file (the nested state dict ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` gives)
  or as safetensors (the model's weights, for serving).
- :func:`import_checkpoint`: a folder written by stock ``torch.distributed.checkpoint.save`` adopted
  as a committed checkpoint of a store, through :meth:`CheckpointManager.save` (write lease, digests,
  manifest written last, ``latest.json``), after the whole folder was read and checked: a folder that
  is not a safe, complete DCP checkpoint changes nothing in the store.

Both hold the whole state in memory once (as ``dcp_to_torch_save`` does). Format 3 checkpoints need
neither to be read by stock torch: ``dcp.load`` with ``FileSystemReader`` reads them in place.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from .layout import MANIFEST, METADATA, checkpoint_steps, step_key
from ..contract.errors import BadInput, CorruptCheckpoint

if TYPE_CHECKING:
    from .layout import CheckpointInfo
    from .manager import CheckpointManager

FORMATS = ("torch", "safetensors")
MODEL_PREFIX = "model."  # TrainingState saves the model's state dict under "model"


def template(metadata: Any) -> dict[str, Any]:
    """A flat state dict with one entry per stored item: an empty tensor of its full size and dtype,
    or None for a non-tensor value (DCP fills both)."""
    import torch

    out: dict[str, Any] = {}
    for fqn, meta in metadata.state_dict_metadata.items():
        out[fqn] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype) if hasattr(meta, "chunks") else None
    return out


def nest(flat: dict[str, Any], planner_data: Any) -> dict[str, Any]:
    """The nested state dict the flat one was saved from, by DCP's ``planner_data`` paths (keys of
    dicts and indices of lists); entries without a path stay flat."""
    root: dict[str, Any] = {}
    paths = planner_data if isinstance(planner_data, dict) else {}
    for fqn, value in flat.items():
        path = tuple(paths.get(fqn) or (fqn,))
        node: Any = root
        for key, following in zip(path, path[1:]):
            empty: Any = {} if type(following) is str else []
            if isinstance(node, list):
                node.extend([None] * (key + 1 - len(node)))
                if node[key] is None:
                    node[key] = empty
                node = node[key]
            else:
                node = node.setdefault(key, empty)
        if isinstance(node, list):
            node.extend([None] * (path[-1] + 1 - len(node)))
        node[path[-1]] = value
    return root


def _read_store_metadata(mgr: "CheckpointManager", step: int) -> Any:
    from .safe_pickle import load_metadata

    key = f"{step_key(step)}/{METADATA}"
    try:
        body = mgr.store.read_bytes(key)
    except FileNotFoundError:
        raise CorruptCheckpoint(f"{mgr.store.uri_for(key)} is missing") from None
    return load_metadata(body, source=mgr.store.uri_for(key))  # checked against its digest by the load


def export_checkpoint(mgr: "CheckpointManager", to: str | os.PathLike, *, step: int | None = None,
                      fmt: str = "torch") -> "CheckpointInfo":
    """Write checkpoint ``step`` (default: the latest) of ``mgr``'s store to the local file ``to``.

    ``fmt="torch"``: ``torch.save`` of the nested state dict, what ``dcp_to_torch_save`` writes
    (tensors whole, unsharded; non-tensor values as they were saved). ``fmt="safetensors"``: the
    tensors under ``model.`` with that prefix removed (a ``TrainingState``'s model weights, loadable
    with ``model.load_state_dict(safetensors.torch.load_file(path))``), or every tensor by its flat
    name when the state has no ``model``; non-tensor values are left out. The file is written to a
    temporary name beside ``to`` and renamed, so ``to`` is never half written.

    Raises:
        BadInput: no checkpoint in the store, an unknown format, or no directory for ``to``.
        CorruptCheckpoint: the checkpoint does not verify (every byte read is checked).
    """
    if fmt not in FORMATS:
        raise BadInput(f"export format {fmt!r} is not one of {', '.join(FORMATS)}")
    target = Path(to)
    if not target.parent.is_dir():
        raise BadInput(f"--to {str(to)!r}: directory {str(target.parent)!r} does not exist")
    if target.is_dir():
        raise BadInput(f"--to {str(to)!r} is a directory; name the file to write")
    if step is None:
        latest = mgr.latest()
        if latest is None:
            raise BadInput(f"no committed checkpoint to export in {mgr.store.uri}")
        step = latest.step
    mgr.verify(step, deep=False)  # a manifest of a readable version, every file with its size
    metadata = _read_store_metadata(mgr, step)
    flat = template(metadata)
    info = mgr.load(flat, step=step)
    if fmt == "torch":
        payload: Any = nest(flat, metadata.planner_data)
    else:
        payload = _model_tensors(flat)
        if not payload:
            raise BadInput(f"checkpoint {info.uri} holds no tensors to export as safetensors")
    _write_atomic(target, payload, fmt, {"relaunch_step": str(step), "relaunch_source": info.uri})
    return info


def _model_tensors(flat: dict[str, Any]) -> dict[str, Any]:
    import torch

    tensors = {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)}
    model = {k[len(MODEL_PREFIX):]: v.contiguous() for k, v in tensors.items() if k.startswith(MODEL_PREFIX)}
    return model or {k: v.contiguous() for k, v in tensors.items()}


def _write_atomic(target: Path, payload: Any, fmt: str, meta: dict[str, str]) -> None:
    import torch

    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    os.close(fd)
    try:
        if fmt == "torch":
            torch.save(payload, tmp)
        else:
            from safetensors.torch import save_file

            save_file(payload, tmp, metadata=meta)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def import_checkpoint(mgr: "CheckpointManager", source: str | os.PathLike, *,
                      step: int | None = None,
                      adopt: Callable[[dict[str, Any], int, str], Any] | None = None) -> "CheckpointInfo":
    """Adopt the stock DCP checkpoint folder ``source`` as committed checkpoint ``step`` of ``mgr``'s
    store (default: one after the newest step directory in the store, or 0).

    The folder is read whole first, safely (``.metadata`` through the restricted unpickler, values
    with ``torch.load(weights_only=True)``); then it is saved like a training's checkpoint (format 3,
    every chunk digested, the manifest written last, ``latest.json`` advanced) under the manager's
    write lease. A folder with a ``model`` but no training ``progress`` (a stock ``{"model",
    "optimizer"}``) is saved as ``adopt(state, step, source)`` makes it, when the caller gives one (the
    trainer's adopter: with the progress, schedule and counters a training resumes from). Any other folder keeps its structure (``planner_data``), so
    ``dcp_to_torch_save`` of the adopted checkpoint gives what it gave of the folder.
    The manager's retention runs after the commit.

    Raises:
        BadInput: ``source`` is not a readable, safe DCP checkpoint folder; ``step`` is committed
            already or older than the latest committed checkpoint (``latest.json`` only moves
            forward); ``adopt`` refused it; another writer holds the lease. Nothing in the store is
            changed.
    """
    src = Path(source)
    if not src.is_dir():
        raise BadInput(f"{str(source)!r} is not a directory; pass the folder dcp.save wrote")
    if not (src / METADATA).is_file():
        raise BadInput(f"{str(source)!r} has no {METADATA}: not a torch.distributed.checkpoint folder")
    latest = mgr.latest()
    if step is None:
        steps = checkpoint_steps(mgr.store)
        step = steps[-1] + 1 if steps else 0
    step_key(step)
    if mgr.store.exists(f"{step_key(step)}/{MANIFEST}"):
        raise BadInput(f"checkpoint {mgr.store.uri_for(step_key(step))} is already committed; import at "
                       f"another --step")
    if latest is not None and step < latest.step:
        raise BadInput(f"--step {step} is older than the latest committed checkpoint ({latest.step}) of "
                       f"{mgr.store.uri}; import at a later step (latest.json only moves forward)")
    state = _read_folder(src)
    if adopt is not None and "progress" not in state and "model" in state:
        state = adopt(state, step, str(source))
    mgr.save(step, state)
    info = mgr.wait()
    assert info is not None
    return info


def _read_folder(src: Path) -> dict[str, Any]:
    """The whole state of a stock DCP folder, nested as it was saved; BadInput when it is not one."""
    import torch.distributed.checkpoint as dcp

    from .dcp_io import safe_load_planner
    from .legacy_v1 import read_metadata, safe_reader

    try:
        metadata = read_metadata(src)
    except CorruptCheckpoint as err:
        raise BadInput(f"{src}: {err}") from None
    from torch.distributed.checkpoint.metadata import Metadata

    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict) \
            or not metadata.state_dict_metadata:
        raise BadInput(f"{src / METADATA} is not the metadata of a torch.distributed.checkpoint save")
    for index, info in metadata.storage_data.items():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or "/" in name or name in ("", ".", "..") or not (src / name).is_file():
            raise BadInput(f"{src}: item {getattr(index, 'fqn', index)!r} is stored in {name!r}, which is not a "
                           f"file of the folder (an incomplete copy?)")
        if getattr(info, "transform_descriptors", None):
            raise BadInput(f"{src}: item {index.fqn!r} uses stream transforms {list(info.transform_descriptors)}, "
                           f"which relaunch does not read; save without extensions")
        if info.offset < 0 or info.offset + info.length > (src / name).stat().st_size:
            raise BadInput(f"{src}/{name} ends before item {index.fqn!r} (truncated?)")
    flat = template(metadata)
    try:
        dcp.load(flat, storage_reader=safe_reader(src), planner=safe_load_planner(), no_dist=True)
    except Exception as err:  # noqa: BLE001 - DCP wraps what the reader raised; any of it is bad input here
        failures = getattr(err, "failures", None) or {}
        originals = [f[0] if isinstance(f, tuple) else f for f in failures.values()] or [err]
        text = str(originals[0]).strip().splitlines()
        raise BadInput(f"{src} is not a readable torch.distributed.checkpoint folder: "
                       f"{type(originals[0]).__name__}: {text[0][:200] if text else ''}") from None
    return nest(flat, metadata.planner_data)


__all__ = ["FORMATS", "export_checkpoint", "import_checkpoint", "nest", "template"]
