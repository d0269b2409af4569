"""The house's rules, checked on the source: steps import only the core (never each other), the core
never imports a step or the pipelines, and no two modules import each other, directly or round a
circle (imports inside functions count: they are circles that merely happen later)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = {p.stem for p in (ROOT / "components").glob("*.py") if p.stem != "__init__"}  # each step one module


def _module_of(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """``{module: the project modules it imports}``, resolving ``from pkg import submodule``."""
    files = [p for top in ("components", "pipelines") for p in (ROOT / top).rglob("*.py")]
    modules = {_module_of(p) for p in files}
    graph: dict[str, set[str]] = {}
    for path in files:
        me = _module_of(path)
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found.add(node.module)
                found |= {f"{node.module}.{a.name}" for a in node.names}
        graph[me] = {m for m in found if m in modules and m != me}
    return graph


def test_no_step_imports_another_step():
    graph = _imports()
    crossings = sorted((me, other) for me, deps in graph.items() if me.count(".") == 1 and me.split(".")[1] in STEPS
                       for other in deps if other.count(".") == 1 and other.split(".")[1] in STEPS)
    assert crossings == []


def test_the_core_imports_no_step_and_no_pipeline_code():
    graph = _imports()
    upward = sorted((me, other) for me, deps in graph.items() if me.startswith("components.core")
                    for other in deps if other.startswith("pipelines") or
                    (other.count(".") == 1 and other.split(".")[1] in STEPS))
    assert upward == []


def test_no_two_modules_import_each_other_round_a_circle():
    graph = _imports()
    # a package's __init__ re-exporting its submodules is not a circle: drop package -> own child edges
    edges = {me: {d for d in deps if not d.startswith(me + ".")} for me, deps in graph.items()}
    circles, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                circles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for start in sorted(edges):
        if start not in state:
            visit(start, [start])
    assert circles == []


def test_every_import_of_a_project_module_names_something_it_has():
    """Imports inside functions run only when the function does: a name removed from a module would
    otherwise surface as an ImportError in the field (a warm start, a failure path)."""
    import importlib

    missing = []
    for path in [p for top in ("components", "pipelines", "tests") for p in (ROOT / top).rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level \
                    and node.module.split(".")[0] in ("components", "pipelines"):
                module = importlib.import_module(node.module)
                for alias in node.names:
                    if alias.name != "*" and not hasattr(module, alias.name):
                        try:
                            importlib.import_module(f"{node.module}.{alias.name}")
                        except ModuleNotFoundError:
                            missing.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.module}.{alias.name}")
    assert missing == []
