"""relaunch's steps (one module each: prepare, locate, launch, evaluate, register, finalize), the launch
backends (``launchers/``), the training tasks (``tasks/``) and the libraries they share (``core/``);
the pipeline that wires the steps is :mod:`relaunch.pipelines.spec`.

Importing the package registers the store URI rules and the launch backends the configuration
validates against (:mod:`relaunch.components.core.contract.registry`), whatever an entry point imports first.
"""

import relaunch.components.core.store  # noqa: F401 - registers the store URI rules
import relaunch.components.launchers  # noqa: F401 - registers the launch backends
