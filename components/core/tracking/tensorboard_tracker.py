"""The TensorBoard tracker (:class:`~relaunch.components.core.tracking.trackers.Tracker`): every metric point as a
scalar in ``tracking.tensorboard_dir``; used only when that folder is set.

Across restarts the folder shows each step once: the writer is flushed before every checkpoint (a rank 0
killed later loses only points after it, which the next attempt computes again), and every attempt
opens its writer with ``purge_step`` at its first step (TensorBoard hides what earlier attempts wrote from
that step on)."""

from __future__ import annotations

from ..contract.errors import BadInput
from .tracker_protocol import AttemptStart, TrackerBase


def open_tracker(config, store, *, run_id: str | None, attempt: int) -> "TensorBoardTracker | None":
    """The TensorBoard tracker, or None when ``tracking.tensorboard_dir`` is unset."""
    folder = config.tracking.tensorboard_dir
    return TensorBoardTracker(folder) if folder else None


class TensorBoardTracker(TrackerBase):
    """A ``SummaryWriter`` on rank 0, opened at the attempt's start."""

    def __init__(self, folder: str):
        self.folder = folder
        self.writer = None

    def start(self, start: AttemptStart) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise BadInput("tracking.tensorboard_dir is set but the tensorboard package is not installed; "
                           "pip install tensorboard or unset it") from None
        # every attempt computes the steps after the one it resumed from (all of them when none): TensorBoard
        # hides what earlier attempts wrote from there on
        self.writer = SummaryWriter(self.folder, purge_step=start.resumed_from + 1)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if self.writer is not None:
            for key, value in metrics.items():
                self.writer.add_scalar(key, value, step)

    def before_checkpoint(self, step: int) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self, timeout: float) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
