"""The README's reference tables are generated from the code; this keeps them from drifting."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from components.core.contract.config import config_reference_markdown, exit_code_markdown

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.mark.parametrize(("marker", "generate"), [("config-reference", config_reference_markdown),
                                                  ("exit-codes", exit_code_markdown)])
def test_readme_table_matches_the_code(marker, generate):
    text = README.read_text()
    found = re.search(rf"<!-- {marker}:start -->\n(.*?)\n<!-- {marker}:end -->", text, re.S)
    assert found, f"README lacks the {marker} markers"
    assert found.group(1) == generate(), "regenerate with: python -m components.core.contract.config"


def test_readme_gives_the_two_setup_commands():
    text = README.read_text()
    assert "make run" in text and "make test" in text
