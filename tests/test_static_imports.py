"""A static tool resolves every ``relaunch.*`` import to its file after ``make venv``: pyright (what Pylance
runs) is asked, without running any import hook, for every module of the tree and every project module that
components/, pipelines/ and tests/ import (by name too, as tests/test_house.py reads them), through the
interpreter of this venv. The names resolve through the links ``make venv`` makes
(``.venv/relaunch-src/relaunch/{components,pipelines}`` and a ``.pth`` that puts the folder on the path):
pip's editable install maps the names with an import hook, which only a running interpreter sees."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.test_house import ROOT, _imported, _module_of, _sources

PYRIGHT = Path(sys.executable).with_name("pyright")  # the test extra pins it (pyproject.toml)


def _wanted() -> dict[str, str]:
    """``{module: where it is imported or defined}`` for every project module the tree names."""
    wanted = {_module_of(p): str(p.relative_to(ROOT)) for p in _sources()}
    for path in [*_sources(), *(ROOT / "tests").rglob("*.py")]:
        for line, module, _ in _imported(path):
            if module.split(".")[0] == "relaunch":
                wanted.setdefault(module, f"{path.relative_to(ROOT)}:{line}")
    return wanted


def test_pyright_resolves_every_relaunch_import_of_the_tree(tmp_path):
    assert PYRIGHT.exists(), f"{PYRIGHT} is missing: make venv installs it (pyproject.toml's test extra)"
    wanted = _wanted()
    order = sorted(wanted)
    # one file of imports, outside the tree: nothing resolves through the working directory
    (tmp_path / "imports.py").write_text("".join(f"import {m}\n" for m in order))
    out = subprocess.run([str(PYRIGHT), "--pythonpath", sys.executable, "--outputjson", "imports.py"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYRIGHT_PYTHON_IGNORE_WARNINGS": "1"})
    assert out.stdout.strip().startswith("{"), out.stdout[-2000:] + out.stderr[-2000:]
    report = json.loads(out.stdout)
    unresolved = sorted(f"{order[d['range']['start']['line']]} ({wanted[order[d['range']['start']['line']]]})"
                        for d in report["generalDiagnostics"] if d.get("rule") == "reportMissingImports")
    assert unresolved == []
    assert report["summary"]["filesAnalyzed"] == 1 and len(order) > 100


def test_a_fresh_interpreter_imports_relaunch_from_the_source_files(tmp_path):
    """Outside the tree, without PYTHONPATH: the name leads to the file in components/ or pipelines/
    (through the links), not to a copy."""
    code = ("import json, relaunch.components.core.store as s, relaunch.pipelines.cli as c; "
            "print(json.dumps([s.__file__, c.__file__]))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    store, cli = (Path(f).resolve() for f in json.loads(out.stdout))
    assert (store, cli) == (ROOT / "components" / "core" / "store" / "__init__.py", ROOT / "pipelines" / "cli.py")
