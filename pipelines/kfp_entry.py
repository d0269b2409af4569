"""What every KFP component body calls: the step's ``run`` with the contract's exit codes.

A lightweight component's body is only ``from relaunch.pipelines.kfp_entry import call`` and
``return call("<step>", config_json, **inputs)``; this turns the JSON configuration into the model,
runs the step, and returns its outputs as the tuple KFP expects (fields in declaration order). Any
error becomes one line on stderr and the process exits with its contract code (the one entry wrapper,
:mod:`relaunch.components.core.contract.entry`, as ``python -m relaunch.components.<step>`` does) (KFP's
executor does not catch ``SystemExit``, and ``sh -c`` passes the code on), so the local
runner (and a reader of the pod's log) can tell a permanent failure from a retryable one. When
``RELAUNCH_EVENTS`` names a file (``relaunch run`` sets it), the ``step-start`` and ``step-end``
events of :mod:`relaunch.components.core.contract.events` are appended to it.

In KFP's executor process the step ends without tearing the interpreter down: every ``atexit``
handler runs (MLflow's, tempfile's, logging is shut down), then ``os._exit`` with the exit status.
Freeing every module of torch and MLflow one by one costs about a second per step and does
nothing the next step needs.
"""

from __future__ import annotations

import atexit
import dataclasses
import importlib
import logging
import os
import sys
from typing import Any

from .spec import STEP_MODULES
from ..components.core.contract import events
from ..components.core.contract.events import Kind
from ..components.core.contract.exitcodes import ExitCode
from ..components.core.runtime import logs
from ..components.core.runtime.wiring import wire

_failed_with: list[int] = []
_ends_without_teardown = False


def _end_without_teardown() -> None:
    """The last ``atexit`` handler (registered before the step imports anything that adds its own)."""
    if _failed_with:
        code = _failed_with[-1]
    elif hasattr(sys, "last_value"):  # the executor failed after the step, e.g. writing its outputs
        from ..components.core.contract.classify import classify

        code = classify(sys.last_value)
    else:
        code = ExitCode.OK
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(code))


def _in_kfp_executor() -> bool:
    main = sys.modules.get("__main__")
    return getattr(getattr(main, "__spec__", None), "name", "") == "kfp.dsl.executor_main"


def call(step: str, config_json: str, **inputs: Any) -> tuple:
    """Run step ``step`` on the configuration ``config_json``; exit with the contract's code on error."""
    from ..components.core.runtime import warm
    from ..components.core.contract.config import RelaunchConfig

    global _ends_without_teardown
    wire()
    if _in_kfp_executor() and not _ends_without_teardown and not warm.forked:  # a warm fork ends so itself
        _ends_without_teardown = True
        atexit.register(_end_without_teardown)
    events.write(Kind.STEP_START, step=step, warm=warm.forked)
    try:
        config = RelaunchConfig.from_json(config_json)
        logs.configure(config, role=step)
        outputs = importlib.import_module(STEP_MODULES[step]).run(config, **inputs)
    except Exception as err:  # noqa: BLE001 - the one entry wrapper's code and line, as `python -m` ends
        from ..components.core.contract.entry import report

        failure = report(step, err)
        _fail(step, failure.exit_code, failure.message)
    values = dataclasses.asdict(outputs)
    events.write(Kind.STEP_END, step=step, exit_code=0, outputs=values)
    return tuple(values.values())


def _fail(step: str, code: int, message: str) -> None:
    _failed_with.append(code)
    events.write(Kind.STEP_END, step=step, exit_code=int(code), message=message)
    raise SystemExit(code)
