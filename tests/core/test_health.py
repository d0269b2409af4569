"""Health units: the spike detector, the preemption flag and the grace rule (components/core/trainer/health.py).
The watchdog and a real NaN are in tests/train/test_health.py."""

from __future__ import annotations

import os
import signal

import pytest

from relaunch.components.core.trainer.health import PreemptionFlag, SpikeDetector, save_fits_grace


def test_spike_detector_counts_spikes_without_letting_them_raise_the_mean():
    spikes = SpikeDetector(factor=3.0, warmup_steps=2)
    flagged = [spikes.update(v) for v in [1.0, 1.0, 1.0, 10.0, 10.0, 1.0]]
    assert flagged == [False, False, False, True, True, False] and spikes.spikes == 2
    restored = SpikeDetector(factor=3.0)
    restored.load_state_dict(spikes.state_dict())
    assert (restored.mean, restored.spikes) == (spikes.mean, 2)


@pytest.mark.parametrize("last_save,left,fits", [(0.0, 1.5, True), (0.0, 1.0, False), (10.0, 16.5, True),
                                                 (10.0, 16.0, False), (2.0, 25.0, True)])
def test_a_save_on_preemption_is_tried_only_with_margin_left_in_the_grace_period(last_save, left, fits):
    assert save_fits_grace(last_save, left) is fits


def test_sigterm_only_sets_the_flag_until_it_is_uninstalled():
    flag = PreemptionFlag().install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert flag.raised and flag.name == "SIGTERM" and flag.seconds_since() >= 0
        os.kill(os.getpid(), signal.SIGUSR1)
        assert flag.name == "SIGTERM"  # the first signal is the one that counts
    finally:
        flag.uninstall()
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
