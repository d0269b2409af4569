"""System metrics sampled through the training, on each node's local rank 0.

A :class:`SystemSampler` starts after the attempt's first step (neither psutil nor MLflow is on a
restarted worker's critical path), samples CPU and memory every ``interval`` seconds on a daemon
thread and stops at the attempt's end with one last sample. The points go into the run as MLflow's
system metrics do (``system/node-<node rank>/cpu_utilization_percentage`` ...: the UI's "System
metrics" tab), through a :class:`~relaunch.components.core.tracking.runlogger.RunLogger` of their own, at the
training step they were taken at: a recomputed step after a restart does not log a point twice.

psutil's CPU figure is the utilisation since its previous call; the sampler calls it once when it
starts, so the first sample measures the interval before it and not 0.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Callable

from ..tracking.runlogger import RunLogger

SAMPLE_SECONDS = 2.0
"""The sampling interval; ``MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL`` (MLflow's own knob) wins."""


def sampling_interval() -> float:
    """``MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL`` when set to a positive number, else :data:`SAMPLE_SECONDS`."""
    raw = os.environ.get("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "")
    try:
        value = float(raw)
    except ValueError:
        return SAMPLE_SECONDS
    return value if value > 0 else SAMPLE_SECONDS


class SystemSampler:
    """Samples this node every ``interval`` seconds into run ``run_id`` until :meth:`stop`.

    Args:
        uri: the tracking URI.
        run_id: the training's MLflow run.
        node_rank: names the metrics (``system/node-<n>/...``).
        step: returns the training step a sample belongs to (read on the sampler's thread).
    """

    def __init__(self, uri: str, run_id: str, node_rank: int, step: Callable[[], int], *,
                 interval: float | None = None):
        self.uri, self.run_id, self.step = uri, run_id, step
        self.prefix = f"system/node-{node_rank}/"
        self.interval = interval or sampling_interval()
        self.samples = 0
        self.logger = None  # RunLogger, made on the sampler's thread
        self._psutil = None
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="relaunch-system-metrics", daemon=True)
        self._stopped = False

    def start(self) -> "SystemSampler":
        """Start the thread (it imports psutil and opens the logger itself: nothing on the caller's time)."""
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            import psutil

            self._psutil = psutil
            self._process = psutil.Process()
            psutil.cpu_percent()  # the baseline: the next call measures from here
            self._process.cpu_percent()
            self.logger = RunLogger(self.uri, self.run_id)
        except Exception as err:  # psutil missing: the training goes on without system metrics
            print(f"relaunch: no system metrics on {self.prefix.rstrip('/')}: {err}", file=sys.stderr)
            return
        finally:
            self._ready.set()
        while not self._stop.wait(self.interval):
            self.sample()

    def sample(self) -> None:
        """Take one sample now and queue it (the logger sends it from its own thread)."""
        if self._psutil is None:
            return
        memory = self._psutil.virtual_memory()
        metrics = {"cpu_utilization_percentage": self._psutil.cpu_percent(),
                   "system_memory_usage_megabytes": memory.used / 1e6,
                   "system_memory_usage_percentage": memory.percent,
                   "process_cpu_percentage": self._process.cpu_percent(),
                   "process_memory_rss_megabytes": self._process.memory_info().rss / 1e6}
        self.logger.log_metrics({self.prefix + k: float(v) for k, v in metrics.items()}, int(self.step()))
        self.samples += 1

    def stop(self, timeout: float, *, last_sample: bool = True) -> None:
        """Stop sampling, take one last sample (unless told not to) and send what is queued, within
        ``timeout`` seconds in all; idempotent. A SIGKILLed attempt loses only what its logger had not sent."""
        if self._stopped:
            return
        self._stopped = True
        self._stop.set()
        if not self._thread.is_alive() and not self._ready.is_set():
            return  # never started
        deadline = time.monotonic() + timeout
        if not self._ready.wait(timeout):
            return  # still importing: nothing was sampled, nothing is worth waiting for
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self.logger is not None:
            if last_sample:
                self.sample()
            self.logger.close(max(0.0, deadline - time.monotonic()))
