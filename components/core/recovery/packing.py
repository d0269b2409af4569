"""A training state packed for the memory tier: a JSON tree of plain values, each tensor (its local part)
replaced by the offset of its bytes in one flat payload (no pickling), and the way back, each tensor's bytes
copied straight into the tensor the live state holds at its place.

    header, payload = pack(snapshot)        # the tree and the tensors' bytes
    restore_into(state, header, payload)    # into the memory the state already holds
"""

from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np
import torch

from ..checkpoint.prefault import populate
from ..checkpoint.snapshot import local_part

ALIGN = 64  # every tensor's bytes start at a multiple of this in the payload



def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"memory tier: unknown tensor dtype {name!r}")
    return dtype


def _tree(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """``obj`` as JSON-able values, each tensor (its local part) replaced by its index in ``tensors``."""
    if isinstance(obj, torch.Tensor):
        local = local_part(obj).detach()
        if local.device.type != "cpu":
            local = local.cpu()
        tensors.append(local.contiguous())
        return {"x": len(tensors) - 1, "dtype": str(local.dtype), "shape": list(local.shape)}
    if isinstance(obj, dict):
        return {"d": [[_tree(k, tensors), _tree(v, tensors)] for k, v in obj.items()]}
    if isinstance(obj, list):
        return {"l": [_tree(v, tensors) for v in obj]}
    if isinstance(obj, tuple):
        return {"t": [_tree(v, tensors) for v in obj]}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise ValueError(f"memory tier: cannot hold a {type(obj).__name__} of the training state")


def new_payload(size: int) -> np.ndarray:
    """``size`` bytes of new memory for a packed state, its pages made present before the bytes arrive
    (faster than faulting each page inside the receive's copy): on the main thread (a replacement
    fetching its replica) by torch's threaded fill, about twice as fast here as ``bytearray(size)``'s
    single memset; on another thread (the replica server taking a peer's put, the snapshot thread) by
    the kernel (``madvise(MADV_POPULATE_WRITE)``, 103 ms against 81 ms for 384 MiB), because a threaded
    fill from a second thread left the main thread's later copies ~20 % slower for the rest of the
    process (a survivor's restore: 40 ms instead of 33 ms for 384 MiB at two intra-op threads; cause not
    found, reproduced only with the tier's transfer)."""
    if threading.current_thread() is threading.main_thread():
        return torch.zeros(size, dtype=torch.uint8).numpy()
    payload = np.zeros(size, dtype=np.uint8)  # calloc: a large one is fresh pages, none present yet
    populate([torch.from_numpy(payload)])
    return payload


def pack(snapshot: Any, into: np.ndarray | None = None) -> tuple[dict, np.ndarray]:
    """The tree of ``snapshot`` (JSON-able) and its tensors' bytes, written into ``into`` when it has
    the very size needed (no new allocation), else into a new buffer."""
    tensors: list[torch.Tensor] = []
    tree = _tree(snapshot, tensors)
    offsets, size = [], 0
    for t in tensors:
        offsets.append(size)
        size += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    payload = into if into is not None and len(into) == size else new_payload(size)
    view = np.frombuffer(payload, dtype=np.uint8) if size else None
    for t, at in zip(tensors, offsets):
        n = t.numel() * t.element_size()
        if n:
            view[at:at + n] = t.reshape(-1).view(torch.uint8).numpy()
    return {"tree": tree, "offsets": offsets, "bytes": size}, payload


def restore_into(state: Any, header: dict, payload: np.ndarray | bytearray | memoryview,
                 live: dict[str, Any] | None = None) -> None:
    """A packed snapshot back into ``state`` (a ``TrainingState``): each tensor's bytes copied from
    ``payload`` straight into the tensor the live state holds at its place (no allocation, no page
    fault, no intermediate view tree), the rest loaded. ``live``: the state's
    :meth:`~TrainingState.live_tensors` when the caller holds them already (a survivor's snapshots
    found them once), else they are asked for. When every model and optimizer tensor found its live
    tensor, the load is told so (``in_place``) and skips handing them back through DCP's
    ``set_state_dict``."""
    template = live if live is not None else state.live_tensors()
    tree = header["tree"]
    if not isinstance(tree, dict) or "d" not in tree:
        raise ValueError("memory tier: a malformed packed state")
    into = _Into(header, payload)
    filled: dict[str, Any] = {}
    with torch.no_grad():
        for key, node in tree["d"]:
            into.watched = key in ("model", "optimizer")
            filled[key] = into.fill(template.get(key), node)
    state.load_state_dict(filled, in_place=not into.cloned)


class _Into:
    """One pass over a packed tree (:func:`pack`): each tensor's bytes into the tensor at the same
    place of a template (a ``state_dict()`` shape of the live state: the memory it already holds,
    DTensors keeping their layout), or, where the template has none, into a clone; plain values
    as they are."""

    def __init__(self, header: dict, payload: np.ndarray | bytearray | memoryview):
        self.offsets = header["offsets"]
        self.whole = torch.frombuffer(payload, dtype=torch.uint8) if header["bytes"] else None  # one export, sliced
        self.watched = False  # filling the model or the optimizer: a clone there means not all in place
        self.cloned = False

    def tensor(self, node: dict) -> torch.Tensor:
        """The packed tensor of ``node``, a view of the payload."""
        dtype, shape = _dtype(node["dtype"]), node["shape"]
        count = math.prod(shape)
        if count == 0:
            return torch.empty(shape, dtype=dtype)
        at = self.offsets[node["x"]]
        return self.whole[at:at + count * dtype.itemsize].view(dtype).view(shape)

    def fill(self, template: Any, node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        if "x" in node:
            if isinstance(template, torch.Tensor):
                local = local_part(template)
                if list(local.shape) != node["shape"] or str(local.dtype) != node["dtype"]:
                    raise ValueError(f"memory tier: a tensor of shape {tuple(node['shape'])} {node['dtype']} does "
                                     f"not fit {tuple(local.shape)} {local.dtype}")
                if local.numel():
                    local.copy_(self.tensor(node))  # in its own dtype: a uint8 copy is ~10% slower here
                return template
            self.cloned = self.cloned or self.watched
            return self.tensor(node).clone()
        if "d" in node:
            inner = template if isinstance(template, dict) else {}
            out = {}
            for k, v in node["d"]:
                key = self.fill(None, k)
                out[key] = self.fill(inner.get(key), v)
            return out
        if "l" in node or "t" in node:
            values = node.get("l", node.get("t"))
            inner = template if isinstance(template, (list, tuple)) and len(template) == len(values) else [None] * len(values)
            items = [self.fill(t, v) for t, v in zip(inner, values)]
            return items if "l" in node else tuple(items)
        raise ValueError("memory tier: a malformed packed state")
