"""The house's rules, checked on the source: the rooms are layers, each importing only the rooms below
it (:data:`LAYERS`, the order docs/architecture.md draws); steps never import each other; no two
modules or packages import each other, directly or round a circle. Every import counts, those inside
functions too (they are the same dependency, merely taken later), relative ones, and those made by name:
``importlib.import_module("relaunch....")`` or ``__import__`` with a literal, and in a module that imports
by a name it computes, every module of ours it names in a string (a preload list, a ``"module:factory"``
table). No module fills the contract's registry when imported: one function wires a process. And relaunch
installs under ``relaunch.*`` only: nothing of ours is imported under a generic top-level name."""

from __future__ import annotations

import ast
import functools
import importlib
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("components", "pipelines")  # installed as relaunch.components and relaunch.pipelines
STEPS = {p.stem for p in (ROOT / "components").glob("*.py") if p.stem != "__init__"}  # each step one module

LAYERS = (
    "relaunch.components.core.contract",    # the config model, exit codes, errors, events, the step names
    "relaunch.components.core.store",       # bytes in a store: filesystem and object-store drivers, records, the run ledger
    "relaunch.components.core.runtime",     # processes: distributed set-up, the warm zygote, a step's CLI
    "relaunch.components.core.data",        # datasets as committed shards, the global sample order, the loaders
    "relaunch.components.tasks",            # what is trained: a task's model and data
    "relaunch.components.core.checkpoint",  # the commit protocol, sharded save and load, leases, retention
    "relaunch.components.core.tracking",    # MLflow and the other trackers, lineage, goodput
    "relaunch.components.core.trainer",     # the training loop's parts
    "relaunch.components.core.recovery",    # where a process starts: memory, the newest commit, resume_from, warm start
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


IMPORTERS = {"import_module", "__import__", "run_module"}
"""Functions that import a module by name (``importlib.import_module``, ``__import__``, ``runpy.run_module``)."""


def _callee(node: ast.Call) -> str:
    return node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")


def _absolute(path: Path, level: int, module: str | None) -> str:
    """The absolute name of ``from <level dots><module> import ...`` in ``path``."""
    package = _module_of(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    base = package[:len(package) - level + 1]
    return ".".join([*base, *([module] if module else [])])


def _imported(path: Path) -> list[tuple[int, str, list[str]]]:
    """``[(line, module, names)]`` of every import in ``path``: inside functions too, relative ones made
    absolute, and those made by name (:data:`IMPORTERS` with a literal; in a module that imports by a computed
    name, every string naming a module of ours, ``"module"`` or ``"module:attribute"``)."""
    tree = ast.parse(path.read_text())
    found, by_name, strings = [], False, []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = _absolute(path, node.level, node.module) if node.level else node.module
            if module:
                found.append((node.lineno, module, [a.name for a in node.names]))
        elif isinstance(node, ast.Call) and _callee(node) in IMPORTERS and node.args:
            name = node.args[0]
            if isinstance(name, ast.Constant) and isinstance(name.value, str):
                found.append((node.lineno, name.value, []))
            else:
                by_name = True
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("relaunch."):
            strings.append((node.lineno, node.value.partition(":")[0], []))
    if by_name and path.is_relative_to(ROOT / "components") or by_name and path.is_relative_to(ROOT / "pipelines"):
        found += [s for s in strings if s[1] in _our_modules()]
    return found


@functools.cache
def _our_modules() -> frozenset[str]:
    return frozenset(_module_of(p) for p in _sources())


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


def test_the_house_sees_imports_made_by_name_and_relative_ones():
    """A dependency taken through ``importlib`` or a ``"module:factory"`` table is a dependency too."""
    graph = _imports()
    assert "relaunch.pipelines.commands.run" in graph["relaunch.pipelines.cli"]  # importlib.import_module(name)
    assert "relaunch.components.core.tracking.mlflow_tracker" in graph["relaunch.components.core.tracking.trackers"]
    store = ROOT / "components" / "core" / "store"
    assert _absolute(store / "s3.py", 1, "object_store") == "relaunch.components.core.store.object_store"
    assert _absolute(store / "__init__.py", 2, "contract.errors") == "relaunch.components.core.contract.errors"


def test_every_import_by_name_of_a_module_of_ours_names_it_in_a_literal():
    """``import_module(f"relaunch.x.{name}")`` hides its modules from the house (and from a reader): a
    module that imports by a computed name keeps the names it may import as literals."""
    hidden = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and _callee(node) in IMPORTERS and node.args:
                first = node.args[0]
                parts = first.values if isinstance(first, ast.JoinedStr) else [first.left] if isinstance(
                    first, ast.BinOp) else []
                if any(isinstance(p, ast.Constant) and str(p.value).startswith("relaunch.") for p in parts):
                    hidden.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(first)}")
    assert hidden == []


REGISTRY = "relaunch.components.core.contract.registry"
MUTATORS = {"append", "extend", "insert", "update", "setdefault", "pop", "clear", "__setitem__"}


def _registering() -> tuple[set[str], list[str]]:
    """``(functions, calls)``: the qualified names of the functions of ours that fill the contract's registry
    (mutate one of its tables, or call such a function), and ``"file:line name"`` of every such call made
    while a module is imported (at module level, in a class body, a decorator, a default value)."""
    registry_path = ROOT / "components" / "core" / "contract" / "registry.py"
    tables = {f"{REGISTRY}.{t.id}" for node in ast.parse(registry_path.read_text()).body
              if isinstance(node, (ast.Assign, ast.AnnAssign))
              for t in (node.targets if isinstance(node, ast.Assign) else [node.target]) if isinstance(t, ast.Name)}
    trees = {_module_of(p): (p, ast.parse(p.read_text())) for p in _sources()}
    aliases: dict[str, dict[str, str]] = {}  # module -> local name -> qualified name
    for me, (path, tree) in trees.items():
        names = aliases.setdefault(me, {})
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                module = _absolute(path, node.level, node.module) if node.level else node.module
                for a in node.names:
                    names[a.asname or a.name] = f"{module}.{a.name}"
            elif isinstance(node, ast.Import):
                names.update({a.asname or a.name: a.name for a in node.names if a.asname})
        names.update({n.name: f"{me}.{n.name}" for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))})

    def resolve(me: str, expr: ast.expr) -> str:
        if isinstance(expr, ast.Name):
            qualified = aliases[me].get(expr.id, f"{me}.{expr.id}")
        elif isinstance(expr, ast.Attribute):
            qualified = f"{resolve(me, expr.value)}.{expr.attr}"
        else:
            return ""
        for _ in range(5):  # a name re-exported by a package (launchers' register_launch_backend)
            module, _, name = qualified.rpartition(".")
            qualified = aliases.get(module, {}).get(name, qualified) if module != me else qualified
        return qualified

    def fills(me: str, body: ast.AST, known: set[str]) -> list[tuple[int, str]]:
        out = []
        for node in ast.walk(body):
            if isinstance(node, ast.Call):
                callee = resolve(me, node.func)
                owner = resolve(me, node.func.value) if isinstance(node.func, ast.Attribute) else ""
                if callee in known or owner in tables and node.func.attr in MUTATORS:
                    out.append((node.lineno, callee))
            elif isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
                targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
                out += [(node.lineno, resolve(me, t.value)) for t in targets
                        if isinstance(t, ast.Subscript) and resolve(me, t.value) in tables]
        return out

    functions: set[str] = set()
    while True:
        grown = {f"{me}.{fn.name}" for me, (_, tree) in trees.items() for fn in ast.walk(tree)
                 if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fills(me, fn, functions)}
        if grown <= functions:
            break
        functions |= grown

    def at_import(node: ast.AST):  # what runs while a module is imported: not its functions' bodies, nor its main
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
            return
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):  # a decorator is a call
            yield from (d if isinstance(d, ast.Call) else ast.copy_location(ast.Call(d, [], []), d)
                        for d in node.decorator_list)
            node.decorator_list = []  # (a copy of the tree per test: parsed anew each time)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield from node.args.defaults
            return
        yield node
        for child in ast.iter_child_nodes(node):
            yield from at_import(child)

    calls = []
    for me, (path, tree) in trees.items():
        for statement in tree.body:
            for node in at_import(statement):
                if isinstance(node, (ast.Call, ast.Assign, ast.AugAssign, ast.Delete)):
                    shallow = ast.Module(body=[ast.Expr(node)] if isinstance(node, ast.Call) else [node], type_ignores=[])
                    calls += [f"{path.relative_to(ROOT)}:{line} {name}" for line, name in fills(me, shallow, functions)]
    return functions, sorted(set(calls))


def test_no_module_fills_the_contracts_registry_when_imported():
    """The registry is filled by one function every entry point calls
    (:func:`relaunch.components.core.runtime.wiring.wire`), never as a side effect of an import: which
    backends a process knew would otherwise depend on what it happened to import first."""
    functions, calls = _registering()
    assert {f"{REGISTRY}.register_store_uri_parser", f"{REGISTRY}.register_launch_backend",
            "relaunch.components.core.runtime.wiring.wire"} <= functions  # the check finds the fillers
    assert calls == []


def test_importing_the_packages_and_entry_points_leaves_the_registry_empty_until_wired():
    """The same, run: a fresh interpreter imports the package roots and every entry point's module."""
    modules = sorted({"relaunch.components", "relaunch.components.launchers", "relaunch.components.core.store",
                      "relaunch.components.core.tracking.trackers", "relaunch.pipelines.cli", "relaunch.pipelines.kfp_entry",
                      "relaunch.components.core.runtime.stepcli", *(f"relaunch.components.{s}" for s in STEPS - {"train"})})
    code = (f"import importlib, sys\nfor m in {modules!r}: importlib.import_module(m)\n"
            "from relaunch.components.core.contract import registry as r\n"
            "from relaunch.components.core.runtime.wiring import wire\n"
            "print(r.wired(), sorted(r.LAUNCH_BACKENDS)); wire(); print(r.wired())")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT / "tests", capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines() == ["False []", "True"]


def test_the_tasks_a_user_copies_import_relaunch_by_its_absolute_name():
    """Inside the packages imports are relative (a tool that maps imports to files by folder follows them),
    but a task module is the user's template: a copy of it outside the project (tests/pipelines/
    test_lineage_e2e.py runs digits.py as ``mytask.py``) has no parent package to be relative to."""
    relative = [f"{p.relative_to(ROOT)}:{node.lineno}" for p in (ROOT / "components" / "tasks").glob("*.py")
                for node in ast.walk(ast.parse(p.read_text())) if isinstance(node, ast.ImportFrom) and node.level]
    assert relative == []


STORE_OPENS = {
    # path, enclosing function: how many open_store calls it may make, and why it opens by URI itself
    ("components/prepare.py", "check_inputs"): 1,            # a probe with fewer, shorter retries (retries=2) before anything starts
    ("components/register.py", "_pin"): 1,                   # the store its checkpoint URI names, which may be another one
    ("components/train.py", "setup"): 1,                     # the worker process's one store, wrapped (injection, in-place tier)
    ("components/tasks/lm.py", "_store_corpus"): 1,          # the user's task: a corpus named by URI
    ("components/tasks/lm.py", "tokenizer"): 1,              # the user's task: its tokenizer's dataset manifest
    ("components/launchers/torchrun.py", "exit_code"): 1,    # a torchrun's end, read once; also `--map-exit` (a Slurm script's process)
    ("components/launchers/rayjob.py", "mapped"): 1,         # a failed RayJob's exit record, read once after it ended
    ("components/core/packaging/model.py", "save_model"): 1,  # the model packaged from a checkpoint named by URI
    ("components/core/data/loader.py", "_rows_of"): 1,       # the data loader's worker process: a store does not cross a fork
    ("components/core/checkpoint/verify.py", "checked_step"): 1,  # a checkpoint named by URI, checked alone
    ("components/core/checkpoint/manager.py", "__init__"): 1,  # the checkpoint manager given a URI
    ("components/core/checkpoint/load.py", "source_of"): 1,  # a resume_from in another store than the training's
    ("components/core/tracking/context.py", "store"): 1,     # the one place a process opens its configuration's store
    ("pipelines/commands/trainings.py", "trainings"): 2,     # `relaunch trainings --store URI`: the root, then each training once
    ("pipelines/commands/checkpoints.py", "_targets"): 1,     # `relaunch checkpoints --store URI`
}
"""Where a module opens a store from a URI itself; everywhere else a step, a command or a helper is handed
the store or the :class:`~relaunch.components.core.tracking.context.Context` of its configuration."""


def _store_opens() -> dict[tuple[str, str], int]:
    """``(path, enclosing function) -> open_store calls`` outside the store package."""
    found: dict[tuple[str, str], int] = {}

    def visit(node: ast.AST, path: str, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            if isinstance(child, ast.Call) and _callee(child) == "open_store":
                found[(path, function)] = found.get((path, function), 0) + 1
            visit(child, path, inner)

    store = ROOT / "components" / "core" / "store"
    for path in _sources():
        if store not in path.parents:
            visit(ast.parse(path.read_text()), str(path.relative_to(ROOT)), "<module>")
    return found


def test_a_process_opens_its_store_once_through_its_context():
    """A step's ``run(config)`` and the commands build one context per configuration and hand it down:
    46 ``open_store`` calls outside the store package before (the same store up to six times a process)."""
    found = _store_opens()
    extra = sorted(f"{path} {function}: {n} open_store call(s), {STORE_OPENS.get((path, function), 0)} allowed"
                   for (path, function), n in found.items() if n > STORE_OPENS.get((path, function), 0))
    assert extra == [], "take the store or the Context from the caller (or add the site to STORE_OPENS, with why)"
    assert sum(found.values()) <= sum(STORE_OPENS.values()) == 16
