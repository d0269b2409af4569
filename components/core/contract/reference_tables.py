"""The reference tables the docs carry, generated from the code so that they cannot drift: the
configuration's fields (docs/configuration.md) and the exit codes (README). ``tests/test_readme.py``
compares each page's table with these; regenerate them with

    python -m relaunch.components.core.contract.reference_tables
"""

from __future__ import annotations

import json

from pydantic import BaseModel

from .config import RelaunchConfig
from .exitcodes import MEANING, RETRYABLE


def config_reference_markdown() -> str:
    """The configuration table of docs/configuration.md, generated from the model so the docs cannot drift."""
    rows = ["| field | default | meaning |", "|---|---|---|"]

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            annotation = field.annotation
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                walk(annotation, f"{prefix}{name}.")
                continue
            default = field.get_default(call_default_factory=True)
            shown = "—" if default is None else f"`{json.dumps(default)}`"
            rows.append(f"| `{prefix}{name}` | {shown} | {field.description or ''} |")

    walk(RelaunchConfig, "")
    return "\n".join(rows)


def exit_code_markdown() -> str:
    """The README's exit-code table, generated from :mod:`relaunch.components.core.contract.exitcodes`."""
    rows = ["| code | meaning | retried |", "|---|---|---|"]
    for code, meaning in sorted(MEANING.items()):
        rows.append(f"| {int(code)} | {meaning} | {'yes' if code in RETRYABLE else ('—' if code == 0 else 'no')} |")
    return "\n".join(rows)


if __name__ == "__main__":  # the tables of docs/configuration.md and README
    print(config_reference_markdown())
    print()
    print(exit_code_markdown())
