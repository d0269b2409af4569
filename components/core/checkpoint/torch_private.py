"""The one module of relaunch that uses private names of torch (2.13): each where torch has no public way
to do the same. tests/core/test_torch_private_api.py pins the shape of each, so that a torch upgrade that
changes one fails there, by name, instead of inside a save or a load.

- :func:`storage_info` (``filesystem._StorageInfo``): where an item lies in a data file. DCP pickles it
  into ``.metadata`` under that module and name, so it is part of the stored format: stock
  ``FileSystemReader`` reads our checkpoints through it, and every checkpoint written so far names it.
- :func:`dtensor_like` (``DTensor(local, spec)`` with ``DTensor._spec``): a DTensor over a CPU buffer
  with the layout of a live one. The public ``DTensor.from_local`` moves the local tensor to its mesh's
  device, which would copy a CPU snapshot of a CUDA shard back onto the GPU.
- :func:`parameter_fqns` (``state_dict._get_fqns``): the names DCP gives a parameter (wrappers such as
  ``torch.compile``'s and FSDP's taken out), which nothing public returns for one parameter.
- :data:`TENSOR_REBUILD_GLOBAL` (``torch._utils._rebuild_tensor_v2``): the global that every tensor record
  ``torch.save`` writes names, so every DCP checkpoint's items name it. dcp_io builds a tensor's archive
  itself, byte for byte what ``torch.save`` writes, instead of calling it per tensor (64 MiB as 4,096
  tensors, docs/benchmarks.md: a sync save 6.82 -> 1.71 s); it checks its output against ``torch.save``
  before use, and tests/core/test_checkpoint_archives.py compares them for every dtype it builds.
"""

from __future__ import annotations

from typing import Any

TENSOR_REBUILD_GLOBAL = b"ctorch._utils\n_rebuild_tensor_v2\n"
"""The pickle GLOBAL opcode (protocol 2) of the function a ``torch.save`` tensor record is rebuilt by."""

# torch is imported inside each function: the checkpoint manager's modules import this one and stay
# importable without torch (the CLI's listing commands).


def storage_info(relative_path: str, offset: int, length: int) -> Any:
    """The ``.metadata`` entry of an item: ``length`` bytes at ``offset`` of the data file
    ``relative_path``, as DCP's ``FileSystemWriter`` records it."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return _StorageInfo(relative_path, offset, length)


def dtensor_like(local: Any, like: Any) -> Any:
    """A DTensor whose local part is ``local`` (kept where it is, no copy) and whose mesh, placements,
    global shape and stride are those of the DTensor ``like``; it does not require grad."""
    from torch.distributed.tensor import DTensor

    return DTensor(local, like._spec, requires_grad=False)


def parameter_fqns(model: Any, name: str) -> set[str]:
    """The fully qualified names under which DCP's state-dict helpers store ``model``'s parameter
    ``name`` (as ``named_parameters`` gives it)."""
    from torch.distributed.checkpoint.state_dict import _get_fqns

    return set(_get_fqns(model, name))


__all__ = ["TENSOR_REBUILD_GLOBAL", "dtensor_like", "parameter_fqns", "storage_info"]
