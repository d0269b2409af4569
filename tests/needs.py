"""A test's optional dependency: skipped with its reason on a machine without it, a failure under CI (``CI``
set), where every lane must run, as the schema tests do without ``../shared``."""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest


def needed(module: str, reason: str) -> ModuleType:
    """``module`` imported; without it, skip (``reason`` says how to install it), or fail under CI."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        if os.environ.get("CI"):
            pytest.fail(f"CI must have {module} ({err}): {reason}", pytrace=False)
        pytest.skip(reason, allow_module_level=True)
        raise  # unreachable: skip raises
