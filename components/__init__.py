"""relaunch's steps (one module each: prepare, locate, launch, evaluate, register, finalize), the launch
backends (``launchers/``), the training tasks (``tasks/``) and the libraries they share (``core/``);
the pipeline that wires the steps is :mod:`relaunch.pipelines.spec`.

Importing the package does nothing else: the tables the configuration validates against are filled by
the one wiring function, :func:`relaunch.components.core.runtime.wiring.wire`, which every entry point calls.
"""
