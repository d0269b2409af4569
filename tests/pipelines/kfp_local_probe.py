"""A tiny pipeline that measures what kfp.local does with set_retry, dsl.If inside an ExitHandler and
exit codes; run as ``python -m tests.pipelines.kfp_local_probe DIR [--fixed]``, prints one JSON line."""

# no `from __future__ import annotations`: kfp reads the annotations as types

import json
import sys
from pathlib import Path
from typing import NamedTuple

from kfp import dsl, local


@dsl.component(base_image="python:3.11", install_kfp_package=False)
def flaky(marker: str, code: int) -> NamedTuple("Out", [("passed", bool), ("attempts", int)]):
    import os
    import sys

    n = int(open(marker).read()) if os.path.exists(marker) else 0
    open(marker, "w").write(str(n + 1))
    if n == 0:
        sys.exit(code)
    return (True, n + 1)


@dsl.component(base_image="python:3.11", install_kfp_package=False)
def gated(marker: str):
    open(marker + ".gated", "w").write("ran")


@dsl.component(base_image="python:3.11", install_kfp_package=False)
def on_exit(marker: str, status: dsl.PipelineTaskFinalStatus):
    open(marker + ".exit", "w").write(status.state)


@dsl.pipeline(name="probe")
def probe(marker: str, code: int):
    with dsl.ExitHandler(on_exit(marker=marker)):
        f = flaky(marker=marker, code=code).set_retry(num_retries=2, backoff_duration="1s", backoff_factor=2.0,
                                                        backoff_max_duration="2s")
        f.set_caching_options(False)
        with dsl.If(f.outputs["passed"] == True):  # noqa: E712
            gated(marker=marker)


def main() -> None:
    root, fixed = Path(sys.argv[1]), "--fixed" in sys.argv
    if fixed:
        from relaunch.pipelines.local.kfp_fixes import install_local_fixes

        install_local_fixes()
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(root / "kfp"), raise_on_error=False)
    result = {}
    for code in (138, 2):
        marker = root / f"m{code}"
        probe(marker=str(marker), code=code)
        result[str(code)] = {"attempts": int(marker.read_text()), "gated_ran": Path(f"{marker}.gated").exists(),
                             "exit_state": Path(f"{marker}.exit").read_text()}
    print("PROBE " + json.dumps(result))


if __name__ == "__main__":
    main()
