"""A real task factory for tests: the digits task, counting how often this process built it."""

from __future__ import annotations

from relaunch.components.tasks.digits import make_task as _digits_task

built = 0


def make_task(config):
    global built
    built += 1
    return _digits_task(config)
