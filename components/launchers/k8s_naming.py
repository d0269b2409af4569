"""Kubernetes names derived from a pipeline run id, so a retried step finds what its previous attempt made.

Names are DNS-1035 labels (what Services need: the Training Operator makes one per replica, named
``<job>-master-0``), short enough that the operator's suffixes still fit in 63 characters.
"""

from __future__ import annotations

import hashlib
import re

from ..core.contract.steps import LAUNCH

# ``<job>-worker-NNN`` plus the operator's own suffixes must stay within a 63-character label.
MAX_JOB_NAME = 45
_INVALID = re.compile(r"[^a-z0-9-]+")


def run_hash(pipeline_run_id: str, length: int = 10) -> str:
    """A short, stable, label-safe digest of any pipeline run id (Argo uid, KFP run id, free text)."""
    if not pipeline_run_id:
        raise ValueError("pipeline_run_id must not be empty")
    return hashlib.sha256(pipeline_run_id.encode()).hexdigest()[:length]


def job_name(pipeline_name: str, pipeline_run_id: str, step: str = LAUNCH) -> str:
    """The PyTorchJob name of ``step`` in one pipeline run: ``<pipeline>-<step>-<hash>``.

    The same inputs always give the same name; different run ids give different names.
    """
    suffix = f"-{step}-{run_hash(pipeline_run_id)}"
    head = _INVALID.sub("-", pipeline_name.lower()).strip("-")[: MAX_JOB_NAME - len(suffix)].rstrip("-")
    name = f"{head or 'relaunch'}{suffix}"
    if not name[0].isalpha():
        name = f"r{name}"[:MAX_JOB_NAME]
    return name
