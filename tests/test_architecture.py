"""The dependency rule of ARCHITECTURE.md, one test per rule.

Every module of the package is read as text (ast): its ``import`` statements, and every string
that is exactly a module path of ours (``"composer_replication.run.replica"``), because lazy
re-export tables and entrypoint names are dependencies too. A failing test names each offending
module and what it imports.

The one exemption is ``composer_replication.diloco.serverless``: the seeds' import path, kept as a
façade of lazy re-exports with no code of its own (ARCHITECTURE.md, "Compatibility façade");
``test_facade_holds_no_code`` keeps it that way.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import composer_replication

PKG_DIR = Path(composer_replication.__file__).parent
ROOT = "composer_replication"
FACADE = "composer_replication.diloco.serverless"
_MODULE_STRING = re.compile(r"composer_replication(\.[A-Za-z_]\w*)+(:[\w.]+)?")


def module_name(path: Path, pkg_dir: Path = PKG_DIR) -> str:
    rel = path.relative_to(pkg_dir.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def references(path: Path, pkg_dir: Path = PKG_DIR) -> list[str]:
    """Modules of ours that ``path`` imports or names as a module-path string."""
    tree = ast.parse(path.read_text(), filename=str(path))
    me = module_name(path, pkg_dir)
    is_pkg = path.name == "__init__.py"
    out: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = me.split(".")
                base = base[: len(base) - node.level + (1 if is_pkg else 0)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.append(mod)
            # `from composer_replication.loss import _logprobs` imports a private module too
            out.extend(
                f"{mod}.{alias.name}"
                for alias in node.names
                if alias.name.startswith("_") and not alias.name.startswith("__")
            )
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if _MODULE_STRING.fullmatch(node.value):
                out.append(node.value.split(":")[0])
    return [m for m in out if m == ROOT or m.startswith(ROOT + ".")]


def layer(module: str) -> str:
    """The top-level package (layer) of a module of ours: 'run', 'cli', 'loss', ..."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def all_modules(pkg_dir: Path = PKG_DIR) -> dict[str, Path]:
    return {module_name(p, pkg_dir): p for p in sorted(pkg_dir.rglob("*.py"))}


def violations(
    sources: set[str], forbidden: set[str], pkg_dir: Path = PKG_DIR, *, skip_facade: bool = True
) -> list[str]:
    """'module -> imported' for every module in a layer of ``sources`` that references a
    module in a layer of ``forbidden`` (its own layer never counts)."""
    found = []
    for mod, path in all_modules(pkg_dir).items():
        if layer(mod) not in sources:
            continue
        if skip_facade and (mod == FACADE or mod.startswith(FACADE + ".")):
            continue
        for ref in references(path, pkg_dir):
            if layer(ref) in forbidden and layer(ref) != layer(mod):
                found.append(f"{mod} -> {ref}")
    return sorted(set(found))


LAYERS = {
    "loss",
    "trainer",
    "data",
    "tasks",
    "models",
    "diloco",
    "exchange",
    "executors",
    "faults",
    "recipes",
    "run",
    "config",
    "cli",
    "assembly",
}


# Foundation modules every layer may use: plain helpers that import nothing of ours.
FOUNDATION = {"lazy", "fields", "json_types"}


def test_every_module_is_in_a_known_layer():
    unknown = sorted(
        m for m in all_modules() if m != ROOT and layer(m) not in LAYERS | FOUNDATION | {"__main__"}
    )
    assert unknown == [], "new top-level package: add it to ARCHITECTURE.md and LAYERS"


def test_foundation_imports_nothing_of_ours():
    assert violations(FOUNDATION, LAYERS) == []


def test_loss_imports_nothing_of_ours():
    assert violations({"loss"}, LAYERS - {"loss"}) == []


def test_trainer_imports_only_loss_and_data():
    assert violations({"trainer"}, LAYERS - {"trainer", "loss", "data"}) == []


def test_data_tasks_models_are_leaves():
    # tasks may use data's prompt_key (the trainer's data layer); nothing else of ours.
    assert violations({"data", "models"}, LAYERS) == []
    assert violations({"tasks"}, LAYERS - {"data"}) == []


def test_diloco_and_exchange_know_nothing_of_runs_trainers_or_tasks():
    forbidden = {"run", "cli", "trainer", "data", "tasks", "models", "config", "loss", "recipes"}
    assert violations({"diloco", "exchange"}, forbidden | {"executors", "faults", "assembly"}) == []


def test_exchange_does_not_import_diloco():
    # diloco (outer loop, synchronizer) sits on the exchange, never the other way round.
    assert violations({"exchange"}, {"diloco"}) == []


def test_executors_know_nothing_of_training():
    forbidden = {"loss", "trainer", "diloco", "exchange", "data", "tasks", "models", "recipes"}
    assert violations({"executors"}, forbidden | {"run", "cli", "config", "faults"}) == []


def test_faults_act_on_the_store_only():
    # the chaos injector signals pids and flips bytes in the store; it knows no trainer or run
    assert violations({"faults"}, LAYERS - {"faults", "exchange"}) == []


def test_config_composes_the_components_configs():
    # each component owns its config (diloco: the [diloco] section; faults: [chaos]; models:
    # [model]; tasks: [task]; data: [teachers]; loss: [loss]); the run schema composes them and
    # takes names and defaults from the registries
    allowed = {"config", "loss", "diloco", "exchange", "executors", "faults"}
    allowed |= {"models", "tasks", "data"}
    assert violations({"config"}, LAYERS - allowed) == []


def test_assembly_builds_every_part_from_the_config():
    allowed = {
        "assembly",
        "config",
        "tasks",
        "models",
        "trainer",
        "data",
        "loss",
        "diloco",
        "exchange",
        "executors",
        "faults",
    }
    assert violations({"assembly"}, LAYERS - allowed) == []


def test_only_run_and_recipes_import_assembly():
    assert violations(LAYERS - {"run", "cli", "recipes"}, {"assembly"}) == []


def test_nothing_imports_run_or_cli():
    assert violations(LAYERS - {"run", "cli"}, {"run", "cli"}) == []
    # cli sits on run; run never imports cli
    assert violations({"run"}, {"cli"}) == []


def test_no_private_imports_across_layers():
    found = []
    for mod, path in all_modules().items():
        if mod == FACADE or mod.startswith(FACADE + "."):
            continue
        for ref in references(path):
            if layer(ref) == layer(mod):
                continue
            if any(part.startswith("_") for part in ref.split(".")[1:]):
                found.append(f"{mod} -> {ref}")
    assert sorted(set(found)) == []


def test_facade_holds_no_code():
    """The seeds' façade only maps names to modules: no function or class definitions."""
    facade_dir = PKG_DIR / "diloco" / "serverless"
    for path in facade_dir.glob("*.py"):
        tree = ast.parse(path.read_text())
        defs = [
            n.name
            for n in tree.body
            if isinstance(n, ast.FunctionDef | ast.ClassDef) and n.name != "__getattr__"
        ]
        assert defs == [], f"{path.name} defines {defs}: code belongs in its layer"


MAX_RUN_FUNCTION_LINES = 80


def long_functions(package: Path, limit: int = MAX_RUN_FUNCTION_LINES) -> list[str]:
    """'module.function: N lines' for every function (or method) of ``package`` longer than
    ``limit`` lines, from its ``def`` to its last line."""
    found = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > limit:
                    found.append(f"{path.stem}.{node.name}: {lines} lines")
    return found


def test_run_sequences_in_short_functions():
    """run/ starts, watches and stops what assembly/ builds: no function of it over 80 lines."""
    assert long_functions(PKG_DIR / "run") == []


# A component of exchange/ or diloco/ takes its config object, not its settings one by one
# (issue 38: `ObjectStoreAllReduce.__init__` once took 22 parameters, the outer loop 16).
MAX_COMPONENT_PARAMETERS = 10


def wide_signatures(package: Path, limit: int = MAX_COMPONENT_PARAMETERS) -> list[str]:
    """'module.function: N parameters' for every function (or method) of ``package`` that takes
    more than ``limit`` parameters (``self`` / ``cls`` not counted, ``*args`` / ``**kwargs``
    each one)."""
    found = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                a = node.args
                params = [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]
                names = [p.arg for p in params if p is not None]
                n = len(names) - (names[:1] in (["self"], ["cls"]))
                if n > limit:
                    found.append(f"{path.stem}.{node.name}: {n} parameters")
    return found


def test_components_take_their_config_not_exploded_settings():
    """No function in exchange/ or diloco/ takes more than 10 parameters: a component takes its
    config object (the section's dataclass or a small composed one, e.g. `AllReduceConfig`,
    `LearnerConfig`, `StreamingOptions`) instead of its settings one by one."""
    assert wide_signatures(PKG_DIR / "exchange") + wide_signatures(PKG_DIR / "diloco") == []


def mode_tests(package: Path) -> list[str]:
    """'module:line' wherever ``package`` reads ``<...>.diloco.mode`` or ``.diloco.manager``."""
    found = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if (
                isinstance(node, ast.Attribute)
                and node.attr in ("mode", "manager")
                and isinstance(node.value, ast.Attribute)
                and node.value.attr == "diloco"
            ):
                found.append(f"{path.stem}:{node.lineno} .diloco.{node.attr}")
    return found


def test_run_asks_the_outer_loop_mode_instead_of_testing_it():
    """The registry (diloco/mode_registry.py) picks the outer-loop mode once; run/ calls the
    mode's methods and never reads `[diloco] mode` / `manager` itself."""
    assert mode_tests(PKG_DIR / "run") == []


# What run/ once asked a mode instead of calling its hooks (issue 38): flags that aliased the
# mode's name. The mode's hooks (diloco/mode_protocol.py) answer run/'s questions instead.
MODE_CAPABILITIES = {
    "lockstep",
    "has_synchronizer",
    "store_departures",
    "driver_synchronizer",
    "elastic",
}
# The diloco/ modules run/ may import: the seam and what every mode shares (the heartbeat, the
# resume states' format), never a mode's own module.
DILOCO_SEAM = {
    "composer_replication.diloco.mode_protocol",
    "composer_replication.diloco.replica_state",
    "composer_replication.diloco.heartbeat",
}
# Compatibility re-exports: the benchmarks import Decoupled DiLoCo's chaos checker from
# run/chaos.py, where it used to live.
DILOCO_REEXPORTS = {
    "composer_replication.run.chaos": {"composer_replication.diloco.decoupled.decoupled_check"}
}


def _diloco_names(tree: ast.AST) -> set[str]:
    """The names a module binds to something of diloco/ (classes, functions, modules)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
            "composer_replication.diloco"
        ):
            names |= {alias.asname or alias.name for alias in node.names}
        elif isinstance(node, ast.Import):
            names |= {
                alias.asname or alias.name.split(".")[0]
                for alias in node.names
                if alias.name.startswith("composer_replication.diloco")
            }
    return names


def _is_class_test(node: ast.AST, diloco: set[str]) -> bool:
    """``isinstance(x, C)`` / ``issubclass(x, C)`` / ``type(x) is C`` with C from diloco/."""

    def from_diloco(expr: ast.expr) -> bool:
        return any(isinstance(n, ast.Name) and n.id in diloco for n in ast.walk(expr))

    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        if node.func.id in ("isinstance", "issubclass") and len(node.args) == 2:
            return from_diloco(node.args[1])
    if isinstance(node, ast.Compare) and isinstance(node.left, ast.Call):
        call = node.left
        if isinstance(call.func, ast.Name) and call.func.id == "type":
            return any(from_diloco(c) for c in node.comparators)
    return False


def mode_branches(package: Path, pkg_dir: Path = PKG_DIR) -> list[str]:
    """'module:line what' wherever ``package`` asks which outer-loop mode it has: reads one of
    `MODE_CAPABILITIES`, tests an object's class against one of diloco/, or imports a module of
    diloco/ beyond `DILOCO_SEAM` (a mode's own module)."""
    found = []
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        diloco = _diloco_names(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in MODE_CAPABILITIES:
                found.append(f"{path.stem}:{node.lineno} .{node.attr}")
            elif _is_class_test(node, diloco):
                found.append(f"{path.stem}:{node.lineno} tests a diloco class")
        me = module_name(path, pkg_dir)
        allowed = DILOCO_SEAM | DILOCO_REEXPORTS.get(me, set())
        for ref in sorted(set(references(path, pkg_dir))):
            if layer(ref) == "diloco" and ref not in allowed:
                found.append(f"{path.stem} imports {ref}")
    return found


def test_run_calls_the_modes_hooks_without_asking_which_mode_it_has():
    """Each outer-loop mode implements the hooks run/ calls (`OuterLoopMode`, `ReplicaLoop`);
    run/ reads no capability flag, tests no diloco class and imports no mode's module."""
    assert mode_branches(PKG_DIR / "run") == []


def test_every_module_name_is_unique():
    """One concept per module, and one module per name: a name says where a thing lives."""
    seen: dict[str, list[str]] = {}
    for mod, path in all_modules().items():
        if path.name != "__init__.py" and not (mod == FACADE or mod.startswith(FACADE + ".")):
            seen.setdefault(path.stem, []).append(mod)
    shared = {name: mods for name, mods in seen.items() if len(mods) > 1}
    assert shared == {}, shared


def imported_modules(path: Path, pkg_dir: Path = PKG_DIR) -> list[str]:
    """Modules of ours that ``path`` imports with an import statement anywhere in it: at module
    level, inside a function, under ``if TYPE_CHECKING:``. ``from package import name`` counts as
    importing the submodule ``package.name`` when there is one, else the package itself."""
    modules = all_modules(pkg_dir)
    tree = ast.parse(path.read_text(), filename=str(path))
    me = module_name(path, pkg_dir)
    is_pkg = path.name == "__init__.py"
    out: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = me.split(".")
                base = base[: len(base) - node.level + (1 if is_pkg else 0)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for alias in node.names:
                sub = f"{mod}.{alias.name}"
                out.append(sub if sub in modules else mod)
    return sorted({m for m in out if m in modules and m != me})


def import_cycles(pkg_dir: Path = PKG_DIR) -> list[list[str]]:
    """Every import circle among the modules of one package (layer): the strongly connected
    components of its import graph with more than one module, each sorted.

    Function-level imports count: they only postpone the circle to run time. Module paths named
    as strings (lazy re-export tables, registries of entrypoints) do not: they are looked up by
    name when used, which is how a registry names its implementations without a circle.
    """
    modules = all_modules(pkg_dir)
    graph = {
        mod: [m for m in imported_modules(path, pkg_dir) if layer(m) == layer(mod)]
        for mod, path in modules.items()
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(cycles)


def test_no_import_cycle_inside_a_package():
    """A circle means the modules are one concept split in two, or a shared vocabulary that
    belongs in a leaf module (exchange/vocabulary.py is the exchange's)."""
    assert import_cycles() == []


# --------------------------------------------------------------- the checker itself can fail


@pytest.fixture
def bad_tree(tmp_path: Path) -> Path:
    """A copy of the layout with deliberately bad imports, one per rule."""
    pkg = tmp_path / ROOT
    files = {
        "__init__.py": "",
        "loss/__init__.py": "",
        "loss/compose.py": "from composer_replication.trainer import ComposerConfig\n",
        "trainer/__init__.py": "",
        "trainer/trainer.py": "from composer_replication.loss._logprobs import x\n",
        "exchange/__init__.py": "",
        "exchange/store_manager.py": "from composer_replication.diloco.outer_loop import DiLoCoOuterLoop\n",
        "diloco/__init__.py": "",
        "diloco/outer_loop.py": "import composer_replication.run.replica\n",
        "diloco/serverless/__init__.py": "_LAZY = {'x': 'composer_replication.run.replica'}\n",
        "executors/__init__.py": "",
        "executors/local.py": "from ..exchange import store\n",
        "tasks/__init__.py": "",
        "tasks/task.py": "ENTRY = 'composer_replication.run.replica:main'\n",
        "run/__init__.py": "",
        "run/replica.py": "",
        # a circle inside exchange/, closed by a function-level import
        "exchange/protocol.py": "from composer_replication.exchange import contribution_screening\n",
        "exchange/contribution_screening.py": "def f():\n    from .protocol import x\n",
    }
    for rel, text in files.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    return pkg


def test_the_size_and_mode_checks_name_the_offender(tmp_path: Path):
    run = tmp_path / "run"
    run.mkdir()
    body = "".join(f"    x{i} = {i}\n" for i in range(80))
    (run / "driver.py").write_text(
        f"def short():\n    return 1\n\n\ndef long():\n{body}\n\n"
        "def branch(config):\n    return config.diloco.mode == 'sync'\n"
    )
    assert long_functions(run) == ["driver.long: 81 lines"]
    assert mode_tests(run) == ["driver:89 .diloco.mode"]


def test_the_signature_check_names_the_offender(tmp_path: Path):
    args = ", ".join(f"a{i}" for i in range(10))
    (tmp_path / "store.py").write_text(
        f"class C:\n    def __init__(self, {args}):\n        pass\n\n"
        f"    def wide(self, {args}, *, more=1):\n        pass\n\n\n"
        f"def f({args}, **kw):\n    pass\n"
    )
    assert wide_signatures(tmp_path) == ["store.f: 11 parameters", "store.wide: 11 parameters"]


def test_the_mode_branch_check_names_each_offender(bad_tree: Path):
    run = bad_tree / "run"
    run.mkdir(exist_ok=True)
    (run / "watch.py").write_text(
        "from composer_replication.diloco.decoupled import DecoupledLearner as Learner\n"
        "from composer_replication.diloco.mode_protocol import OuterLoopMode\n\n\n"
        "def watch(mode, loop):\n"
        "    if mode.lockstep and isinstance(loop.outer, Learner):\n"
        "        return type(mode) is OuterLoopMode\n"
        "    return mode.elastic(2)\n"
    )
    assert sorted(mode_branches(run, bad_tree)) == [
        "watch imports composer_replication.diloco.decoupled",
        "watch:6 .lockstep",
        "watch:6 tests a diloco class",
        "watch:7 tests a diloco class",
        "watch:8 .elastic",
    ]


def test_the_checker_names_each_bad_import(bad_tree: Path):
    assert violations({"loss"}, LAYERS - {"loss"}, bad_tree) == [
        "composer_replication.loss.compose -> composer_replication.trainer"
    ]
    assert violations({"exchange"}, {"diloco"}, bad_tree) == [
        "composer_replication.exchange.store_manager -> composer_replication.diloco.outer_loop"
    ]
    assert violations({"executors"}, {"exchange"}, bad_tree) == [
        "composer_replication.executors.local -> composer_replication.exchange"
    ]
    # import statement and module-path string alike; the façade is exempt
    assert violations(LAYERS - {"run", "cli"}, {"run"}, bad_tree) == [
        "composer_replication.diloco.outer_loop -> composer_replication.run.replica",
        "composer_replication.tasks.task -> composer_replication.run.replica",
    ]
    assert import_cycles(bad_tree) == [
        [
            "composer_replication.exchange.contribution_screening",
            "composer_replication.exchange.protocol",
        ]
    ]
    assert "composer_replication.loss._logprobs" in references(
        bad_tree / "trainer" / "trainer.py", bad_tree
    )


# The one class whose settings are inherited from two dataclasses by design: the loss library's
# one list of settings, channel 1's and channels 2-3's, which TRL's `GRPOConfig` subclass and the
# other surfaces inherit in part (ARCHITECTURE.md, "One source for every default and name").
SHARED_SETTINGS = {"composer_replication.loss.loss_settings.LossSettings"}


def _is_dataclass_decorator(node: ast.expr) -> bool:
    target = node.func if isinstance(node, ast.Call) else node
    name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
    return name == "dataclass"


def combined_configs(pkg_dir: Path = PKG_DIR) -> list[str]:
    """'module.Class: Base1, Base2' for every class that inherits from two or more of the
    package's dataclasses (a config composes its components' configs as fields instead)."""
    trees = {
        mod: ast.parse(path.read_text(), str(path)) for mod, path in all_modules(pkg_dir).items()
    }
    dataclasses_ = {
        node.name
        for tree in trees.values()
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef) and any(map(_is_dataclass_decorator, node.decorator_list))
    }
    found = []
    for mod, tree in trees.items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            bases = [
                b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "") for b in node.bases
            ]
            ours = [b for b in bases if b in dataclasses_]
            if len(ours) >= 2 and f"{mod}.{node.name}" not in SHARED_SETTINGS:
                found.append(f"{mod}.{node.name}: {', '.join(ours)}")
    return sorted(found)


def test_configs_compose_their_components_instead_of_inheriting_them():
    """No class inherits from two or more of our dataclasses: a section holds its components'
    configs as fields (`fields.component`: `DilocoConfig.outer`, `.exchange`, ...), each checks
    itself, and the loader reads their keys flat (ARCHITECTURE.md, "One source ...")."""
    assert combined_configs() == []


def test_the_composition_check_names_the_offender(tmp_path: Path):
    pkg = tmp_path / "composer_replication"
    pkg.mkdir()
    (pkg / "section.py").write_text(
        "from dataclasses import dataclass\nimport dataclasses\n\n\n"
        "@dataclass\nclass A:\n    a: int = 1\n\n\n"
        "@dataclasses.dataclass(frozen=True)\nclass B:\n    b: int = 2\n\n\n"
        "class Mixin:\n    pass\n\n\n"
        "@dataclass\nclass Both(A, B):\n    pass\n\n\n"
        "@dataclass\nclass One(A, Mixin):\n    pass\n\n\n"
        "@dataclass\nclass Composed:\n    a: A = dataclasses.field(default_factory=A)\n"
    )
    assert combined_configs(pkg) == ["composer_replication.section.Both: A, B"]
