"""Step 2, ``locate-latest-checkpoint``: the checkpoint training starts from, or none.

In order: the newest committed checkpoint of this training (a restarted pipeline continues where it
stopped), else ``train.resume_from``, else the checkpoint behind ``train.warm_start_model`` (a
registered model version), else none (``checkpoint_uri=""``, ``step=-1``). Never cached: a cached
"latest checkpoint" is a wrong one.

    python -m components.locate --config configs/local.yaml                        # the newest training
    python -m components.locate --config configs/local.yaml --input training=20261204-030501

By hand, a ``store.uri`` that is a root of trainings (``trainings/<time>/``, what ``relaunch run``
writes) is read as its newest training, or the one ``--input training=ID`` names: the answer is the one
the pipeline's locate gives that training (:func:`run_by_hand`).
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


def run_by_hand(config: RelaunchConfig, training: str = "") -> LocateOutputs:
    """:func:`run` on the training a by-hand call means: ``training`` (an id under ``trainings/``), else
    the newest training when ``store.uri`` is a root of trainings, else the store itself.

    Raises:
        BadInput: as :func:`run`; also an unknown ``training``.
    """
    from components.core.store import open_store
    from components.core.store.trainings import pick_training, resolve_trainings

    store = open_store(config.store.uri)
    found = [(training, pick_training(store, training, "--input training="))] if training else resolve_trainings(store)
    name, uri = found[-1]
    if name is not None:
        newest = f" (the newest of {len(found)}; --input training=ID picks another)" if len(found) > 1 else ""
        print(f"locate: training {name}{newest}: {uri}", file=sys.stderr)
        config = config.model_copy(deep=True)
        config.store.uri = uri
    return run(config)


if __name__ == "__main__":
    from components import step_name
    from components.core.runtime.stepcli import step_main

    sys.exit(step_main(step_name(__spec__.name), run_by_hand))
