"""The model fingerprint a checkpoint manifest carries: which model a checkpoint holds."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def model_fingerprint(model: torch.nn.Module) -> str:
    """A short stable description of a model's parameter/buffer names, shapes and dtypes.

    Stored in the checkpoint manifest; loading a checkpoint whose fingerprint differs is refused.
    """
    module = getattr(model, "module", model)  # DDP
    items = [f"{name}:{tuple(t.shape)}:{t.dtype}" for name, t in module.state_dict().items()]
    return "sha256:" + hashlib.sha256("\n".join(items).encode()).hexdigest()[:32]
