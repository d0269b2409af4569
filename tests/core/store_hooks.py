"""Wrappers of the external store interface (``relaunch.components.core.store.Store``) that change its
timing, never its answers: a partition (every call waits while it lasts) and a slow link."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable


class Partition:
    """The store as a process cut off from it sees it: from the first call that ``trigger(name,
    args)`` matches, every call (from any thread: the save, the heartbeat) waits until ``heal()``."""

    def __init__(self, inner: Any, trigger: Callable[[str, tuple], bool]):
        self._inner, self._trigger = inner, trigger
        self._open = threading.Event()
        self._open.set()
        self.cut = threading.Event()  # set once the partition began

    def heal(self) -> None:
        self._open.set()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            if not self.cut.is_set() and self._trigger(name, args):
                self._open.clear()
                self.cut.set()
            self._open.wait()
            return attr(*args, **kwargs)

        return call


class Slow:
    """Every call whose first argument (a key) ``which`` matches takes ``seconds`` longer."""

    def __init__(self, inner: Any, seconds: float, which: Callable[[str, tuple], bool] = lambda n, a: True):
        self._inner, self._seconds, self._which = inner, seconds, which

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            if self._which(name, args):
                time.sleep(self._seconds)
            return attr(*args, **kwargs)

        return call


def key_of(args: tuple) -> str:
    return args[0] if args and isinstance(args[0], str) else ""
