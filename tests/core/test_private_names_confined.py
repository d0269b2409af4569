"""Private names of dependencies (torch, kfp, minio, urllib3, mlflow, the standard library, ...) are used
only in the one guarded module per dependency, each pinned by its own test:

- torch: components/core/checkpoint/torch_private.py (tests/core/test_torch_private_api.py)
- the standard library: components/core/runtime/stdlib_private.py (tests/core/test_private_stdlib.py)
- kfp.local: pipelines/local/kfp_fixes.py (tests/pipelines/test_warm_steps.py, test_kfp_local.py)
- minio and urllib3: components/core/store/s3.py's ``_MinioCalls`` (tests/core/test_storage.py)

Found from the source: an import of a leading-underscore name (or from a leading-underscore module) of
anything outside this project, and an attribute with a leading underscore read from a name such an
import bound (``atexit._run_exitfuncs``, ``torch._C.x``, ``edo.ConditionEvaluator._resolve``).
``os._exit`` is public (documented in the ``os`` module)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GUARDED = {"components/core/checkpoint/torch_private.py", "components/core/runtime/stdlib_private.py",
           "pipelines/local/kfp_fixes.py", "components/core/store/s3.py"}
PUBLIC = {("os", "_exit")}
OURS = ("relaunch", "tests")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _outside_names(tree: ast.AST) -> dict[str, str]:
    """Each local name an import of a module outside this project binds -> the dotted name it stands for."""
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if not alias.name.startswith(OURS):
                    bound[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and not node.module.startswith(OURS):
            for alias in node.names:
                bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return bound


def _uses(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    bound = _outside_names(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and not node.module.startswith(OURS):
            if any(_private(part) for part in node.module.split(".")) or any(_private(a.name) for a in node.names):
                found.append(f"{node.lineno}: from {node.module} import {', '.join(a.name for a in node.names)}")
        elif isinstance(node, ast.Import):
            found += [f"{node.lineno}: import {a.name}" for a in node.names
                      if not a.name.startswith(OURS) and any(_private(part) for part in a.name.split("."))]
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in bound:
                dotted = f"{ast.unparse(node.value)}.{node.attr}"
                if (bound[root.id], node.attr) not in PUBLIC:
                    found.append(f"{node.lineno}: {dotted}")
    return found


def test_private_names_of_dependencies_appear_only_in_their_guarded_modules():
    offenders = {}
    for path in sorted([*ROOT.glob("components/**/*.py"), *ROOT.glob("pipelines/**/*.py")]):
        relative = path.relative_to(ROOT).as_posix()
        if relative not in GUARDED and (uses := _uses(path)):
            offenders[relative] = uses
    assert not offenders, ("private names of dependencies outside their guarded module (use the public API, or "
                           f"move the use into the dependency's guarded module with a pinning test): {offenders}")


def test_the_scan_finds_each_kind_of_private_use(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("import atexit, os\n"
                      "import torch.distributed.checkpoint._traverse\n"
                      "from torch.distributed.checkpoint.filesystem import _StorageInfo\n"
                      "from kfp.local.orchestrator import enhanced_dag_orchestrator as edo\n"
                      "from relaunch.components.core.checkpoint.torch_private import storage_info\n"
                      "atexit._run_exitfuncs()\n"
                      "edo.ConditionEvaluator._resolve_pipeline_channel\n"
                      "os._exit(0)\n"
                      "storage_info._ours\n")
    assert sorted(int(line.split(":")[0]) for line in _uses(sample)) == [2, 3, 6, 7]
