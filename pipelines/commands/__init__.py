"""The ``relaunch`` subcommands, one module each, each with ``add_parser(sub, help_text)`` and ``main(args)``."""

from __future__ import annotations

import argparse
from typing import Any, Protocol


class Subcommands(Protocol):
    """What ``argparse.ArgumentParser.add_subparsers()`` returns, as far as a subcommand uses it."""

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser: ...
