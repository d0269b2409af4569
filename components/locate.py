"""Step 2, ``locate-latest-checkpoint``: reports the checkpoint training starts from, or none.

The rule is :mod:`relaunch.components.core.recovery.start`'s, decided by the training's workers when they load;
this step reports its answer as of now (``checkpoint_uri=""``, ``step=-1``: a fresh start), and launch
hands the answer on as ``train.resume_from``, which the rule maps to itself (or to a checkpoint committed
since). Never cached: a cached "latest checkpoint" is a wrong one.

    python -m relaunch.components.locate --config configs/local.yaml                        # the newest training
    python -m relaunch.components.locate --config configs/local.yaml --input training=20261204-030501

By hand, a ``store.uri`` that is a root of trainings (``trainings/<time>/``, what ``relaunch run``
writes) is read as its newest training, or the one ``--input training=ID`` names: the answer is the one
the pipeline's locate gives that training (:func:`run_by_hand`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from .core.checkpoint import CheckpointManager
from .core.recovery.start import start_point
from .core.contract.config import RelaunchConfig
from .core.store.training_folders import pick_training, resolve_trainings
from .core.tracking.context import Context
from .core.tracking.warm_start import warm_start_checkpoint


@dataclass
class LocateOutputs:
    checkpoint_uri: str
    step: int
    source: str  # "latest" | "resume_from" | "warm_start" | "none"


def run(config: RelaunchConfig) -> LocateOutputs:
    """Report the checkpoint the training starts from (:func:`start_point`, the rule the workers apply).

    Raises:
        BadInput: ``resume_from`` is not a committed relaunch checkpoint, or the warm-start model
            version does not exist or has no checkpoint.
    """
    def fingerprint() -> str:
        from .core.packaging.model import task_fingerprint  # torch: only to check a resume_from

        return task_fingerprint(config)

    with CheckpointManager.from_config(config, async_save=False) as mgr:
        start = start_point(config, mgr, warm_start_lookup=warm_start_checkpoint, fingerprint=fingerprint)
    return LocateOutputs(checkpoint_uri=start.uri, step=start.step, source=start.source)


def run_by_hand(config: RelaunchConfig, training: str = "") -> LocateOutputs:
    """:func:`run` on the training a by-hand call means: ``training`` (an id under ``trainings/``), else
    the newest training when ``store.uri`` is a root of trainings, else the store itself.

    Raises:
        BadInput: as :func:`run`; also an unknown ``training``.
    """
    store = Context(config).store
    found = [(training, pick_training(store, training, "--input training="))] if training else resolve_trainings(store)
    name, uri = found[-1]
    if name is not None:
        newest = f" (the newest of {len(found)}; --input training=ID picks another)" if len(found) > 1 else ""
        print(f"locate: training {name}{newest}: {uri}", file=sys.stderr)
        config = config.model_copy(deep=True)
        config.store.uri = uri
    return run(config)


if __name__ == "__main__":
    from .core.contract import steps
    from .core.runtime.stepcli import step_main

    sys.exit(step_main(steps.LOCATE, run_by_hand))
