"""The compiled Argo documents of the default configuration are committed in tests/golden/ so a
pipeline change shows up as a YAML diff. Regenerate with ``make golden`` (RELAUNCH_UPDATE_GOLDEN=1)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from relaunch.components.core.contract.config import RelaunchConfig
from relaunch.pipelines.argo import BUILDERS, to_yaml

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
FILES = {"argo": "argo-workflow.yaml", "argo-template": "argo-template.yaml", "argo-cron": "argo-cron.yaml"}


@pytest.mark.parametrize("target", list(BUILDERS))
def test_golden_argo_yaml_matches_the_compiled_default_pipeline(target):
    text = to_yaml(BUILDERS[target](RelaunchConfig()))
    path = GOLDEN / FILES[target]
    if os.environ.get("RELAUNCH_UPDATE_GOLDEN"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert path.exists(), f"{path} is missing: run `make golden`"
    assert text == path.read_text(), f"{path.name} differs from the compiled pipeline: review, then `make golden`"
