"""What kfp.local 2.17 does with our pipeline's features, measured on a tiny pipeline, and what the two
fixes of relaunch.pipelines.local.kfp_fixes change. If an upgrade fixes kfp.local, the "as shipped" test fails: then
drop the matching fix."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def _probe(tmp_path, *flags: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "tests.pipelines.kfp_local_probe", str(tmp_path), *flags],
                         capture_output=True, text=True, timeout=120)
    line = next((l for l in out.stdout.splitlines() if l.startswith("PROBE ")), None)
    assert line, out.stdout[-2000:] + out.stderr[-2000:]
    return json.loads(line.removeprefix("PROBE "))


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    return _probe(tmp_path_factory.mktemp("shipped"))


@pytest.fixture(scope="module")
def fixed(tmp_path_factory):
    return _probe(tmp_path_factory.mktemp("fixed"), "--fixed")


def test_kfp_local_honours_set_retry_and_runs_the_exit_handler(shipped):
    assert shipped["138"]["attempts"] == 2
    assert shipped["138"]["exit_state"] == "SUCCEEDED"


def test_kfp_local_as_shipped_skips_a_dsl_if_on_a_task_output_inside_an_exit_handler(shipped):
    assert shipped["138"]["gated_ran"] is False


def test_kfp_local_as_shipped_retries_a_permanent_exit_code(shipped):
    assert shipped["2"]["attempts"] == 2


def test_with_the_fixes_the_gated_task_runs_when_its_condition_holds(fixed):
    assert fixed["138"]["gated_ran"] is True and fixed["138"]["attempts"] == 2


def test_with_the_fixes_a_permanent_exit_code_is_not_retried_and_the_exit_handler_sees_the_failure(fixed):
    assert fixed["2"]["attempts"] == 1
    assert fixed["2"]["gated_ran"] is False
    assert fixed["2"]["exit_state"] == "FAILED"
