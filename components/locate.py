"""Step 2, ``locate-latest-checkpoint``: the checkpoint training starts from, or none.

In order: the newest committed checkpoint of this training (a restarted pipeline continues where it
stopped), else ``train.resume_from``, else the checkpoint behind ``train.warm_start_model`` (a
registered model version), else none (``checkpoint_uri=""``, ``step=-1``). Never cached: a cached
"latest checkpoint" is a wrong one.

    python -m components.locate --config configs/local.yaml
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from components.core.checkpoint.start import warm_start_checkpoint  # noqa: F401 - part of this step's API
from components.core.contract.config import RelaunchConfig


@dataclass
class LocateOutputs:
    checkpoint_uri: str
    step: int
    source: str  # "latest" | "resume_from" | "warm_start" | "none"


def run(config: RelaunchConfig) -> LocateOutputs:
    """Find the checkpoint to start from (``start_point``: the same decision the trainer makes).

    Raises:
        BadInput: ``resume_from`` is not a committed relaunch checkpoint, or the warm-start model
            version does not exist or has no checkpoint.
    """
    from components.core.checkpoint.start import start_point

    from components.core.checkpoint import CheckpointManager
    from components.core.tracking.models import task_fingerprint

    with CheckpointManager.from_config(config, async_save=False) as mgr:
        start = start_point(config, mgr, fingerprint=lambda: task_fingerprint(config))
    return LocateOutputs(checkpoint_uri=start.uri, step=start.step, source=start.source)


if __name__ == "__main__":
    from components import step_name
    from components.core.runtime.stepcli import step_main

    sys.exit(step_main(step_name(__spec__.name), run))
