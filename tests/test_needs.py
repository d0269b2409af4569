"""A test's missing optional dependency is a skip on a developer's machine and a failure under CI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _pytest(tmp_path: Path, ci: bool) -> subprocess.CompletedProcess:
    test = tmp_path / "test_needing_it.py"
    test.write_text("from tests.needs import needed\nneeded('no_such_module_of_relaunch', 'pip install it')\n\n"
                    "def test_it():\n    pass\n")
    env = {k: v for k, v in os.environ.items() if k != "CI"} | ({"CI": "true"} if ci else {})
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                           "--rootdir", str(tmp_path), "-c", os.devnull, str(test)],
                          cwd=tmp_path, env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                          timeout=120)


def test_a_missing_optional_dependency_skips_with_its_reason_and_fails_under_ci(tmp_path):
    here = _pytest(tmp_path, ci=False)
    assert here.returncode in (0, 5) and "1 skipped" in here.stdout, here.stdout  # 5: nothing else collected
    ci = _pytest(tmp_path, ci=True)
    assert ci.returncode != 0 and "CI must have no_such_module_of_relaunch" in ci.stdout, ci.stdout
