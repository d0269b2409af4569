"""The house's rules, checked on the source: the rooms are layers, each importing only the rooms below
it (:data:`LAYERS`, the order docs/architecture.md draws); steps never import each other; no two
modules or packages import each other, directly or round a circle. Every import counts, those inside
functions too: they are the same dependency, merely taken later. And relaunch installs under
``relaunch.*`` only: nothing of ours is imported under a generic top-level name."""

from __future__ import annotations

import ast
import importlib
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("components", "pipelines")  # installed as relaunch.components and relaunch.pipelines
STEPS = {p.stem for p in (ROOT / "components").glob("*.py") if p.stem != "__init__"}  # each step one module

LAYERS = (
    "relaunch.components.core.contract",    # the config model, exit codes, errors, events, the step names
    "relaunch.components.core.store",       # bytes in a store: filesystem and object-store drivers, records
    "relaunch.components.core.runtime",     # processes: distributed set-up, the warm zygote, a step's CLI
    "relaunch.components.tasks",            # what is trained: a task's model and data
    "relaunch.components.core.checkpoint",  # the commit protocol, sharded save and load, leases, retention
    "relaunch.components.core.tracking",    # MLflow and the other trackers, lineage, goodput
    "relaunch.components.core.trainer",     # the training loop's parts
    "relaunch.components.core.packaging",   # the task's model as an MLflow pyfunc model
    "relaunch.components.core.tuning",      # a study of trainings: its Optuna storage, trials and their folders
    "relaunch.components.launchers",        # torchrun locally, PyTorchJob, TrainJob, Slurm
    "relaunch.components",                  # the package root: registers the store rules and the launch backends
    "relaunch.components.<step>",           # the steps, one module each
    "relaunch.pipelines",                   # the pipeline spec, its KFP and Argo renderings, the CLI, the local runner
)
"""The rooms from the bottom up: a module imports modules of its own room or of rooms below it."""


def _module_of(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(["relaunch", *(parts[:-1] if parts[-1] == "__init__" else parts)])


def _sources() -> list[Path]:
    return [p for top in FOLDERS for p in (ROOT / top).rglob("*.py")]


def _imported(path: Path) -> list[tuple[int, str, list[str]]]:
    """``[(line, module, names)]`` of every absolute import in ``path``, inside functions too."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.lineno, node.module, [a.name for a in node.names]))
    return found


def _imports() -> dict[str, set[str]]:
    """``{module: the project modules it imports}``, resolving ``from pkg import submodule``."""
    files = _sources()
    modules = {_module_of(p) for p in files}
    graph: dict[str, set[str]] = {}
    for path in files:
        found: set[str] = set()
        for _, module, names in _imported(path):
            found |= {module} | {f"{module}.{name}" for name in names}
        me = _module_of(path)
        graph[me] = {m for m in found if m in modules and m != me}
    return graph


def _is_step(module: str) -> bool:
    parts = module.split(".")
    return len(parts) == 3 and parts[1] == "components" and parts[2] in STEPS


def layer_of(module: str) -> int:
    """The index in :data:`LAYERS` of ``module``'s room."""
    if _is_step(module):
        return LAYERS.index("relaunch.components.<step>")
    rooms = [room for room in LAYERS if module == room or module.startswith(room + ".")]
    assert rooms, f"{module} is in no room of LAYERS: add its room there"
    return LAYERS.index(max(rooms, key=len))


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


def test_every_module_is_in_a_room_of_the_declared_order():
    assert all(layer_of(module) >= 0 for module in _imports())


def test_each_room_imports_only_its_own_room_and_the_rooms_below_it():
    upward = sorted(f"{me} -> {other}" for me, deps in _imports().items()
                    for other in deps if layer_of(other) > layer_of(me))
    assert upward == []


def test_no_step_imports_another_step():
    crossings = sorted(f"{me} -> {other}" for me, deps in _imports().items() if _is_step(me)
                       for other in deps if _is_step(other))
    assert crossings == []


def test_no_two_modules_import_each_other_round_a_circle():
    graph = _imports()
    # a package's __init__ re-exporting its submodules is not a circle: drop package -> own child edges
    assert _circles({me: {d for d in deps if not d.startswith(me + ".")} for me, deps in graph.items()}) == []


def test_no_two_packages_import_each_other_round_a_circle():
    def package(module: str) -> str:
        return module if ROOT.joinpath(*module.split(".")[1:]).is_dir() else module.rpartition(".")[0]

    packages: dict[str, set[str]] = {}
    for me, deps in _imports().items():
        mine = package(me)
        for theirs in map(package, deps):
            if theirs != mine and not mine.startswith(theirs + ".") and not theirs.startswith(mine + "."):
                packages.setdefault(mine, set()).add(theirs)
    assert _circles(packages) == []


def test_nothing_of_ours_is_imported_under_a_generic_top_level_name():
    """A team's own ``components`` or ``pipelines`` package would shadow it (or it theirs)."""
    generic = sorted(f"{path.relative_to(ROOT)}:{line} {module}" for path in
                     [*_sources(), *(ROOT / "tests").rglob("*.py")] for line, module, _ in _imported(path)
                     if module.split(".")[0] in FOLDERS)
    assert generic == []


def test_the_wheel_lists_every_package_folder():
    """setuptools installs only the packages pyproject.toml names (the folders are mapped under relaunch.*)."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = sorted(_module_of(p) for p in _sources() if p.name == "__init__.py")
    assert sorted(setuptools["packages"]) == folders
    assert setuptools["package-dir"] == {f"relaunch.{f}": f for f in FOLDERS}


def test_every_import_of_a_project_module_names_something_it_has():
    """Imports inside functions run only when the function does: a name removed from a module would
    otherwise surface as an ImportError in the field (a warm start, a failure path)."""
    missing = []
    for path in [*_sources(), *(ROOT / "tests").rglob("*.py")]:
        for line, module, names in _imported(path):
            if module.split(".")[0] != "relaunch" or not names:
                continue
            imported = importlib.import_module(module)
            for name in names:
                if name != "*" and not hasattr(imported, name):
                    try:
                        importlib.import_module(f"{module}.{name}")
                    except ModuleNotFoundError:
                        missing.append(f"{path.relative_to(ROOT)}:{line} {module}.{name}")
    assert missing == []
