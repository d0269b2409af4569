"""The built-in task: a small MLP classifier on scikit-learn's bundled digits (8x8 images, 10
classes, 1797 samples shipped inside the package; nothing is downloaded). Trains in seconds on CPU.

torch is imported by the methods that use it: prepare only builds the splits, and a process that
does not train should not pay for importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from typing import TYPE_CHECKING

import numpy as np

from relaunch.components.core.contract.config import RelaunchConfig
from relaunch.components.core.contract.errors import BadInput
from relaunch.components.tasks.base import Splits

if TYPE_CHECKING:
    import torch
    from torch import nn


def load_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """The 1797 digits exactly as ``sklearn.datasets.load_digits(return_X_y=True)`` returns them.

    Read straight from the ``digits.csv.gz`` scikit-learn ships, without importing scikit-learn:
    its import costs ~3 s per process, which every restarted worker would pay again (MTTR).
    """
    import gzip
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise BadInput("the digits task needs scikit-learn installed (it ships the dataset)")
    path = Path(list(spec.submodule_search_locations)[0]) / "datasets" / "data" / "digits.csv.gz"
    with gzip.open(path, "rt") as fh:
        data = np.loadtxt(fh, delimiter=",")
    return data[:, :-1], data[:, -1].astype(int)


def digits_splits(val_fraction: float, test_fraction: float, seed: int) -> Splits:
    """Stratified train/val/test split of the digits (seeded), features scaled to [0, 1] as float32."""
    x, y = load_digits_arrays()
    x = (x / 16.0).astype(np.float32)
    y = y.astype(np.int64)
    rng = np.random.default_rng(seed)
    parts: dict[str, list[np.ndarray]] = {"train": [], "val": [], "test": []}
    for label in np.flatnonzero(np.bincount(y)):  # np.unique's, without its import of numpy.ma (~20 ms a worker)
        idx = rng.permutation(np.flatnonzero(y == label))
        n_test, n_val = round(len(idx) * test_fraction), round(len(idx) * val_fraction)
        parts["test"].append(idx[:n_test])
        parts["val"].append(idx[n_test:n_test + n_val])
        parts["train"].append(idx[n_test + n_val:])
    out: Splits = {}
    for name, chunks in parts.items():
        idx = np.sort(np.concatenate(chunks))
        out[name] = {"x": x[idx], "y": y[idx]}
    return out


@dataclass
class DigitsTask:
    """MLP 64 -> hidden -> 10, SGD with momentum, cosine learning-rate decay."""

    config: RelaunchConfig

    def build_splits(self) -> Splits:
        d = self.config.data
        return digits_splits(d.val_fraction, d.test_fraction, d.split_seed)

    def build_model(self) -> nn.Module:
        from torch import nn

        hidden = self.config.train.hidden_size
        return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        import torch

        t = self.config.train
        return torch.optim.SGD(model.parameters(), lr=t.lr, momentum=0.9, weight_decay=t.weight_decay)

    def build_scheduler(self, optimizer: torch.optim.Optimizer, total_steps: int):
        import torch

        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(1, total_steps))

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        from torch.nn.functional import cross_entropy

        return cross_entropy(model(batch["x"]), batch["y"])

    def evaluate(self, model: nn.Module, split: dict[str, np.ndarray]) -> dict[str, float]:
        import torch
        from torch.nn.functional import cross_entropy

        was_training = model.training
        model.eval()
        with torch.no_grad():
            logits = model(torch.from_numpy(split["x"]))
            y = torch.from_numpy(split["y"])
            metrics = {"loss": float(cross_entropy(logits, y)),
                       "accuracy": float((logits.argmax(1) == y).float().mean())}
        model.train(was_training)
        return metrics

    def predict(self, model: nn.Module, x: np.ndarray) -> np.ndarray:
        import torch

        was_training = model.training
        model.eval()
        with torch.no_grad():
            labels = model(torch.from_numpy(np.asarray(x, dtype=np.float32))).argmax(1).numpy()
        model.train(was_training)
        return labels


def make_task(config: RelaunchConfig) -> DigitsTask:
    """Factory named by the default ``train.task``."""
    return DigitsTask(config)
