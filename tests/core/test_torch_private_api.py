"""The private torch names relaunch leans on, each with the shape our code was written for: a torch upgrade
that changes one fails here, loudly and by name, instead of somewhere inside a save or a load.

Why each is used (where relaunch found no public way to do the same in torch 2.13):
- ``filesystem._split_by_size_and_type``, ``_StorageInfo``, ``_StoragePrefix``: our StorageWriter lays out
  its files exactly as stock ``FileSystemWriter`` does, so that stock ``FileSystemReader`` reads them
  (checkpoint format 3, components/core/checkpoint/dcp_io.py).
- ``_traverse.set_element``: the safe load planner places a value loaded with ``weights_only=True`` into
  the nested state dict where DCP's default planner would (components/core/checkpoint/dcp_io.py).
- ``state_dict._get_fqns``: the names DCP gives a parameter, to pre-create the optimizer state a load
  fills (components/core/trainer/state.py).
- ``utils._create_file_view`` and ``torch._C.PyTorchFileReader``: reading format-1 checkpoints
  (components/core/checkpoint/legacy_v1.py).

Removed: the warm runtime no longer replaces torch elastic's ``SubprocessHandler._popen`` nor dynamic
rendezvous's ``get_method_name`` / ``_delay`` (workers come from a zygote through torchrun's public
``--no-python`` worker command; tests/pipelines/test_warm_steps.py keeps them out).
"""

from __future__ import annotations

import dataclasses
import inspect

import torch


def _params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def test_the_private_torch_names_relaunch_uses_have_the_shape_it_was_written_for():
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.filesystem import _split_by_size_and_type, _StorageInfo, _StoragePrefix
    from torch.distributed.checkpoint.state_dict import _get_fqns
    from torch.distributed.checkpoint.utils import _create_file_view

    assert _params(_split_by_size_and_type) == ["bins", "items"]
    assert [f.name for f in dataclasses.fields(_StorageInfo)][:3] == ["relative_path", "offset", "length"]
    assert [f.name for f in dataclasses.fields(_StoragePrefix)] == ["prefix"]
    assert _params(set_element) == ["root_dict", "path", "value"]
    assert _params(_get_fqns)[:2] == ["model", "name"]
    assert _params(_create_file_view) == ["file", "offset", "length"]
    assert hasattr(torch._C, "PyTorchFileReader")


def test_the_stdlib_atexit_runner_that_end_process_calls_still_runs_the_registered_handlers(tmp_path):
    """``atexit._run_exitfuncs`` (components/core/runtime/stepcli.py ``wind_down``): a step or a worker
    that ends through ``end_process`` runs its atexit handlers (a pending async save's, MLflow's) and then
    skips the interpreter's module teardown, which costs about a second of CPU with torch and MLflow
    loaded (docs/benchmarks.md). A Python whose atexit lacks it, or whose runner no longer runs the
    handlers, fails here by name."""
    import subprocess
    import sys

    marker = tmp_path / "ran"
    code = ("import atexit, pathlib\n"
            f"atexit.register(pathlib.Path({str(marker)!r}).write_text, 'yes')\n"
            "from components.core.runtime.stepcli import end_process\n"
            "end_process(0)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert marker.read_text() == "yes"
