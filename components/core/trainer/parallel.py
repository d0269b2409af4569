"""How the model is spread over the ranks: DDP (every rank holds everything) or FSDP2 (``fully_shard``:
parameters, gradients and optimizer state are sharded; each rank saves and loads only its shards).

    model = wrap_model(module, parallelism="fsdp", mixed_precision="bf16", blocks=task_blocks)

FSDP2 shards each block first (the Task may name them with ``shard_blocks(model)``; by default every
direct child that holds parameters), then the root. Works with gloo on CPU and nccl on GPU.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from ..contract.errors import BadInput

MIXED_PRECISION = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def default_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every direct child of ``model`` that holds parameters (the layers of a Sequential, the blocks
    of a transformer's ModuleList are one level further down: a task names those itself)."""
    blocks = []
    for child in model.children():
        if isinstance(child, torch.nn.ModuleList):
            blocks += [m for m in child if any(True for _ in m.parameters())]
        elif any(True for _ in child.parameters()):
            blocks.append(child)
    return blocks


def wrap_model(module: torch.nn.Module, *, parallelism: str, device: torch.device, mixed_precision: str = "none",
               blocks: Callable[[torch.nn.Module], list[torch.nn.Module]] | None = None) -> torch.nn.Module:
    """The model the training loop calls: ``module`` itself (one rank, DDP off), wrapped in DDP, or
    sharded in place with FSDP2 (then the returned model is ``module``).

    Raises:
        BadInput: FSDP for a model without parameters, blocks that are not its submodules, or a
            model ``fully_shard`` refuses; mixed precision without FSDP.
    """
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if parallelism == "ddp":
        if mixed_precision != "none":
            raise BadInput("train.mixed_precision needs train.parallelism=fsdp (DDP uses train.amp)")
        if world > 1:
            return torch.nn.parallel.DistributedDataParallel(
                module, device_ids=[device.index] if device.type == "cuda" else None)
        return module
    if parallelism != "fsdp":
        raise BadInput(f"train.parallelism: {parallelism!r} is not ddp or fsdp")
    return _fully_shard(module, device, mixed_precision, blocks)


def _fully_shard(module: torch.nn.Module, device: torch.device, mixed_precision: str,
                 blocks: Callable[[torch.nn.Module], list[torch.nn.Module]] | None) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if not any(p.requires_grad for p in module.parameters()):
        raise BadInput(f"train.parallelism=fsdp: the model {type(module).__name__} has no trainable parameters "
                       f"to shard; use parallelism=ddp")
    if not (dist.is_available() and dist.is_initialized()):
        raise BadInput("train.parallelism=fsdp needs torch.distributed (run under torchrun)")
    chosen = list(blocks(module) if blocks is not None else default_blocks(module))
    inside = {id(m) for m in module.modules()}
    for block in chosen:
        if not isinstance(block, torch.nn.Module) or id(block) not in inside or block is module:
            raise BadInput(f"train.parallelism=fsdp: the task's shard_blocks returned {type(block).__name__}, "
                           f"which is not a submodule of the model")
    dtype = MIXED_PRECISION.get(mixed_precision, "unknown")
    if dtype == "unknown":
        raise BadInput(f"train.mixed_precision: {mixed_precision!r} is not none, bf16 or fp16")
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype else MixedPrecisionPolicy()
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    try:
        for block in chosen:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(module, mesh=mesh, mp_policy=policy)
    except (ValueError, TypeError, AssertionError, NotImplementedError, RuntimeError) as err:
        raise BadInput(f"train.parallelism=fsdp: this model cannot be sharded with fully_shard: "
                       f"{str(err).splitlines()[0][:200]}; use parallelism=ddp") from None
    return module


def total_grad_norm(module: torch.nn.Module, max_norm: float | None = None) -> float:
    """The global gradient norm (L2 over all elements), also when the gradients are DTensor shards;
    with ``max_norm`` the gradients are clipped to it in the same pass (``train.grad_clip_norm``)."""
    norm: Any = torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm or float("inf"))
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)
