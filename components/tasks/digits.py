"""The built-in task: a small MLP classifier on scikit-learn's bundled digits (8x8 images, 10
classes, 1797 samples shipped inside the package; nothing is downloaded). Trains in seconds on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from components.core.config import RelaunchConfig
from components.tasks.base import Splits


def digits_splits(val_fraction: float, test_fraction: float, seed: int) -> Splits:
    """Stratified train/val/test split of the digits, features scaled to [0, 1] as float32."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    x = (data.data / 16.0).astype(np.float32)
    y = data.target.astype(np.int64)
    x_rest, x_test, y_rest, y_test = train_test_split(x, y, test_size=test_fraction, random_state=seed, stratify=y)
    val_share = val_fraction / (1.0 - test_fraction)
    x_train, x_val, y_train, y_val = train_test_split(
        x_rest, y_rest, test_size=val_share, random_state=seed + 1, stratify=y_rest)
    return {"train": {"x": x_train, "y": y_train}, "val": {"x": x_val, "y": y_val},
            "test": {"x": x_test, "y": y_test}}


@dataclass
class DigitsTask:
    """MLP 64 -> hidden -> 10, SGD with momentum, cosine learning-rate decay."""

    config: RelaunchConfig

    def build_splits(self) -> Splits:
        d = self.config.data
        return digits_splits(d.val_fraction, d.test_fraction, d.split_seed)

    def build_model(self) -> nn.Module:
        hidden = self.config.train.hidden_size
        return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        t = self.config.train
        return torch.optim.SGD(model.parameters(), lr=t.lr, momentum=0.9, weight_decay=t.weight_decay)

    def build_scheduler(self, optimizer: torch.optim.Optimizer, total_steps: int):
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(1, total_steps))

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return nn.functional.cross_entropy(model(batch["x"]), batch["y"])

    @torch.no_grad()
    def evaluate(self, model: nn.Module, split: dict[str, np.ndarray]) -> dict[str, float]:
        was_training = model.training
        model.eval()
        logits = model(torch.from_numpy(split["x"]))
        y = torch.from_numpy(split["y"])
        metrics = {"loss": float(nn.functional.cross_entropy(logits, y)),
                   "accuracy": float((logits.argmax(1) == y).float().mean())}
        model.train(was_training)
        return metrics

    @torch.no_grad()
    def predict(self, model: nn.Module, x: np.ndarray) -> np.ndarray:
        was_training = model.training
        model.eval()
        labels = model(torch.from_numpy(np.asarray(x, dtype=np.float32))).argmax(1).numpy()
        model.train(was_training)
        return labels


def make_task(config: RelaunchConfig) -> DigitsTask:
    """Factory named by the default ``train.task``."""
    return DigitsTask(config)
