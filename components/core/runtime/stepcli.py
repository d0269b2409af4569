"""The thin CLI every step shares: ``python -m relaunch.components.<step> --config FILE | --config-json JSON
[--set key=value ...] [--input name=value ...] [--outputs-dir DIR]``.

It parses, calls the step's ``run(config, **inputs)``, and writes each output field to
``DIR/<field>`` (strings as they are, anything else as JSON) for Argo output parameters, plus the
whole outputs object as one JSON line on stdout. Any error ends as the exit-code contract says, through
the one entry wrapper (:mod:`relaunch.components.core.contract.entry`), as on KFP and in the training worker.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Any, Callable, NoReturn

from ..contract.config_loading import config_from_cli
from ..contract.entry import exit_on_error
from ..contract.errors import BadInput
from . import logs
from .stdlib_private import run_exit_handlers
from .wiring import wire


def outputs_as_dict(outputs: Any) -> dict[str, Any]:
    if outputs is None:
        return {}
    if dataclasses.is_dataclass(outputs):
        return dataclasses.asdict(outputs)
    if hasattr(outputs, "model_dump"):
        return outputs.model_dump()
    if isinstance(outputs, dict):
        return outputs
    raise TypeError(f"step outputs must be a dataclass, pydantic model or dict, got {type(outputs).__name__}")


def write_outputs(outputs: dict[str, Any], directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for key, value in outputs.items():
        text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
        (directory / key).write_text(text)


def step_main(step: str, run: Callable[..., Any], argv: list[str] | None = None) -> int:
    """Entry point of ``python -m relaunch.components.<step>``; returns the process exit code. It wires the
    process first (:func:`~relaunch.components.core.runtime.wiring.wire`)."""
    wire()

    @exit_on_error(step)
    def main() -> int:
        parser = argparse.ArgumentParser(prog=f"python -m relaunch.components.{step.replace('-', '_')}")
        parser.add_argument("--config", help="YAML configuration file")
        parser.add_argument("--config-json", help="the whole configuration as JSON (what pipelines pass)")
        parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
        parser.add_argument("--input", dest="inputs", action="append", default=[], metavar="NAME=VALUE",
                            help="an output of an earlier step")
        parser.add_argument("--outputs-dir", type=Path, help="write each output to DIR/<name>")
        args = parser.parse_args(argv)
        config = config_from_cli(args.config, args.config_json, args.overrides)
        logs.configure(config, role=step)
        inputs: dict[str, str] = {}
        for item in args.inputs:
            if "=" not in item:
                raise BadInput(f"--input {item!r}: expected name=value")
            name, value = item.split("=", 1)
            inputs[name.replace("-", "_")] = value
        outputs = outputs_as_dict(run(config, **inputs))
        if args.outputs_dir:
            write_outputs(outputs, args.outputs_dir)
        print(json.dumps(outputs, sort_keys=True, default=str))
        return 0

    return main()


def wind_down() -> None:
    """What the interpreter does at exit before it frees the modules: join the non-daemon threads,
    run the ``atexit`` handlers, shut logging down, flush the output."""
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    run_exit_handlers()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()


def end_process(code: int) -> NoReturn:
    """Exit with ``code`` as Python would (:func:`wind_down`) but without freeing every module one by
    one: with torch and MLflow loaded that costs a second of CPU per process, and a training restart
    or a pipeline step waits for it."""
    wind_down()
    os._exit(code)
