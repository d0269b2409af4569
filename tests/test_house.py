"""The house's rules, checked on the source: the rooms are layers, each importing only the rooms below
it (:data:`LAYERS`, the order docs/architecture.md draws); steps never import each other; no two
modules or packages import each other, directly or round a circle. Every import counts, those inside
functions too: they are the same dependency, merely taken later."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS = {p.stem for p in (ROOT / "components").glob("*.py") if p.stem != "__init__"}  # each step one module

LAYERS = (
    "components.core.contract",    # the config model, exit codes, errors, events, the step names
    "components.core.store",       # bytes in a store: filesystem and object-store drivers, records
    "components.core.runtime",     # processes: distributed set-up, the warm zygote, a step's CLI
    "components.tasks",            # what is trained: a task's model and data
    "components.core.checkpoint",  # the commit protocol, sharded save and load, leases, retention
    "components.core.tracking",    # MLflow and the other trackers, lineage, goodput
    "components.core.trainer",     # the training loop's parts
    "components.core.packaging",   # the task's model as an MLflow pyfunc model
    "components.launchers",        # torchrun locally, PyTorchJob, TrainJob, Slurm
    "components",                  # the package root: registers the store rules and the launch backends
    "components.<step>",           # the steps, one module each
    "pipelines",                   # the pipeline spec, its KFP and Argo renderings, the CLI, the local runner
)
"""The rooms from the bottom up: a module imports modules of its own room or of rooms below it."""


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


def layer_of(module: str) -> int:
    """The index in :data:`LAYERS` of ``module``'s room."""
    parts = module.split(".")
    if parts[0] == "components" and len(parts) == 2 and parts[1] in STEPS:
        return LAYERS.index("components.<step>")
    rooms = [room for room in LAYERS if module == room or module.startswith(room + ".")]
    assert rooms, f"{module} is in no room of LAYERS: add its room there"
    return LAYERS.index(max(rooms, key=len))


def test_every_module_is_in_a_room_of_the_declared_order():
    assert all(layer_of(module) >= 0 for module in _imports())


def test_each_room_imports_only_its_own_room_and_the_rooms_below_it():
    upward = sorted(f"{me} -> {other}" for me, deps in _imports().items()
                    for other in deps if layer_of(other) > layer_of(me))
    assert upward == []


def test_no_two_packages_import_each_other_round_a_circle():
    packages: dict[str, set[str]] = {}
    for me, deps in _imports().items():
        mine = me if (ROOT / me.replace(".", "/")).is_dir() else me.rpartition(".")[0]
        for other in deps:
            theirs = other if (ROOT / other.replace(".", "/")).is_dir() else other.rpartition(".")[0]
            if theirs != mine and not mine.startswith(theirs + ".") and not theirs.startswith(mine + "."):
                packages.setdefault(mine, set()).add(theirs)
    assert _circles(packages) == []


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


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
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
    return circles


def test_no_two_modules_import_each_other_round_a_circle():
    graph = _imports()
    # a package's __init__ re-exporting its submodules is not a circle: drop package -> own child edges
    assert _circles({me: {d for d in deps if not d.startswith(me + ".")} for me, deps in graph.items()}) == []


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
