"""Training health: non-finite losses, loss spikes, AMP overflows, a hang watchdog, and the
preemption flag (SIGTERM/SIGUSR1) with the rule that decides whether a last save fits the grace period.

A NaN/inf loss is fatal and permanent (:class:`Diverged`, exit 3) and the bad state is never
checkpointed; spikes and overflows are only counted and logged; a rank without step progress for
``hang_timeout_seconds`` dumps every thread's stack and exits with the retryable code, so that the
launcher restarts the group from the last committed checkpoint.
"""

from __future__ import annotations

import faulthandler
import math
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass

from ..contract.exitcodes import ExitCode


# A save on preemption is attempted only when SAVE_MARGIN_FACTOR x the last save's duration plus
# SAVE_MARGIN_SECONDS fits in the grace period left: save times vary (page cache, store latency), and a
# save cut short by the SIGKILL at the end of the grace period is wasted work that also delays the exit.
SAVE_MARGIN_FACTOR = 1.5
SAVE_MARGIN_SECONDS = 1.0


def save_fits_grace(last_save_seconds: float, grace_left_seconds: float) -> bool:
    """Whether a checkpoint that took ``last_save_seconds`` last time can be saved in the grace left."""
    return last_save_seconds * SAVE_MARGIN_FACTOR + SAVE_MARGIN_SECONDS < grace_left_seconds


class PreemptionFlag:
    """SIGTERM/SIGUSR1 handler: records the signal and its time, nothing else (no I/O in a handler)."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self) -> None:
        self.signum: int | None = None
        self.at: float | None = None

    def install(self) -> "PreemptionFlag":
        """From the training loop's start: outside it, a process may sit in a C-level collective or
        rendezvous where a Python handler never runs, so there the default (terminate) is kept."""
        for sig in self.SIGNALS:
            signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig in self.SIGNALS:
            signal.signal(sig, signal.SIG_DFL)

    def _handle(self, signum, _frame) -> None:
        if self.signum is None:
            self.signum, self.at = signum, time.monotonic()

    @property
    def raised(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else "a signal"

    def seconds_since(self) -> float:
        return time.monotonic() - self.at if self.at is not None else 0.0


def is_finite(value: float) -> bool:
    return math.isfinite(value)


@dataclass
class SpikeDetector:
    """Counts losses above ``factor`` x their exponential running mean (after a short warm-up)."""

    factor: float
    beta: float = 0.9
    warmup_steps: int = 10
    mean: float | None = None
    seen: int = 0
    spikes: int = 0

    def update(self, loss: float) -> bool:
        """Feed one finite loss; True when it is a spike."""
        self.seen += 1
        spike = self.mean is not None and self.seen > self.warmup_steps and loss > self.factor * self.mean
        if spike:
            self.spikes += 1
        else:  # a spike must not drag the mean up and hide the next one
            self.mean = loss if self.mean is None else self.beta * self.mean + (1 - self.beta) * loss
        return spike

    def state_dict(self) -> dict:
        return {"mean": -1.0 if self.mean is None else float(self.mean), "seen": self.seen, "spikes": self.spikes}

    def load_state_dict(self, sd: dict) -> None:
        self.mean = None if float(sd["mean"]) < 0 else float(sd["mean"])
        self.seen, self.spikes = int(sd["seen"]), int(sd["spikes"])


class Watchdog:
    """Exits the process when :meth:`beat` has not been called for ``timeout`` seconds.

    The exit is ``ExitCode.RETRY_ME``: a hung collective or a stuck filesystem is worth a restart.
    """

    def __init__(self, timeout: float, *, what: str = "training step", exit_code: int = ExitCode.RETRY_ME,
                 on_hang=None):
        self.timeout = timeout
        self.on_hang = on_hang  # called with the message before the exit (e.g. to record it)
        self.what = what
        self.exit_code = int(exit_code)
        self._last = time.monotonic()
        self._step: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "Watchdog":
        self._last = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="relaunch-watchdog", daemon=True)
        self._thread.start()
        return self

    def beat(self, step: int | None = None) -> None:
        self._last = time.monotonic()
        self._step = step

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(min(1.0, self.timeout / 4)):
            idle = time.monotonic() - self._last
            if idle > self.timeout:
                print(f"relaunch: no {self.what} progress for {idle:.0f}s (last step {self._step}); "
                      f"dumping stacks and exiting {self.exit_code} to be restarted", file=sys.stderr, flush=True)
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                sys.stderr.flush()
                if self.on_hang is not None:
                    try:
                        self.on_hang(f"hung: no {self.what} progress for {idle:.0f}s after step {self._step}")
                    except Exception as err:  # noqa: BLE001 - the exit below must happen whatever this did
                        print(f"relaunch: watchdog callback failed: {err}", file=sys.stderr, flush=True)
                os._exit(self.exit_code)
