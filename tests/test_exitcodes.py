"""The exit-code contract is one table: every code is either permanent or retryable, never both."""

from __future__ import annotations

import signal

import pytest

from relaunch.pipelines.spec import RETRY_POLICIES, STEPS
from relaunch.components.core.contract.exitcodes import PERMANENT, RETRYABLE, ExitCode, is_retryable, normalize


def test_permanent_and_retryable_are_disjoint_and_cover_the_contract():
    assert not PERMANENT & RETRYABLE
    assert {1, 2, 126, 127, 128, 139} <= PERMANENT
    assert {130, 137, 143, 138} <= RETRYABLE
    assert set(ExitCode) - {ExitCode.OK} == PERMANENT | RETRYABLE


@pytest.mark.parametrize(
    ("returncode", "retry"),
    [(-signal.SIGKILL, True), (-signal.SIGTERM, True), (-signal.SIGINT, True), (-signal.SIGSEGV, False),
     (137, True), (143, True), (138, True), (2, False), (1, False), (3, False), (42, False), (0, False)],
)
def test_subprocess_return_codes_map_to_the_shell_convention(returncode, retry):
    assert is_retryable(returncode) is retry
    if returncode < 0:
        assert normalize(returncode) == 128 - returncode


def test_every_step_has_a_retry_policy():
    assert set(RETRY_POLICIES) == set(STEPS)
    assert all(p.limit >= 1 and p.backoff_seconds > 0 and p.factor >= 1 for p in RETRY_POLICIES.values())
