"""Task loading and the default digits task (components/tasks/)."""

from __future__ import annotations

import numpy as np
import pytest

from relaunch.components.core.contract.config import RelaunchConfig
from relaunch.components.core.contract.errors import BadInput
from relaunch.components.tasks.base import load_task
from relaunch.components.tasks.digits import digits_splits, load_digits_arrays


def test_the_digits_task_reads_exactly_what_sklearn_load_digits_returns():
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    ours_x, ours_y = load_digits_arrays()
    assert np.array_equal(x, ours_x) and np.array_equal(y, ours_y)
    splits = digits_splits(0.15, 0.15, 0)
    assert sum(len(s["y"]) for s in splits.values()) == len(y)


@pytest.mark.parametrize("spec,words", [
    ("no_colon", "package.module:factory"),
    ("no.such.module:make", "cannot import module"),
    ("relaunch.components.tasks.digits:nope", "no callable 'nope'"),
    ("relaunch.components.core.contract.config:RelaunchConfig", "cannot be called as factory"),
    ("relaunch.components.core.contract.errors:BadInput", "without build_model"),
])
def test_load_task_refuses_a_bad_spec_with_one_line_naming_it(spec, words):
    with pytest.raises(BadInput, match=words):
        load_task(spec, RelaunchConfig())
