"""The package's layers, checked on its import graph: data flows one way, with no circle and no upward import.

``core`` (errors, budget, the plan and its vocabulary, the device spec, the profile's data types) imports nothing of
memopt_nb above it; ``runtime`` (applying a plan) uses only ``core``; ``profiling`` and ``sim`` (the cost model) each
build on those and not on each other; ``planners`` on the simulator; ``harness`` (evaluate, bench, demo, zoo) and
``notebook`` on top; the package's ``__init__``/``__main__`` (the facade) may use every layer.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "memopt_nb"
LAYERS = {"core": 0, "runtime": 1, "profiling": 2, "sim": 2, "planners": 3, "harness": 4, "notebook": 5}
FACADE = 6


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path) -> list[tuple[str, bool, int]]:
    """(imported memopt_nb module, whether the import sits inside a function, line) for every import in ``path``."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            inside.update(id(n) for n in ast.walk(node) if n is not node)
    out = []
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # `from . import x` names a submodule where one exists
            for alias in node.names:
                sub = f"{mod}.{alias.name}"
                exists = (PACKAGE.parent / (sub.replace(".", "/") + ".py")).exists() or (
                    PACKAGE.parent / sub.replace(".", "/")).is_dir()
                targets.append(sub if exists else mod)
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        for t in targets:
            if t == "memopt_nb" or t.startswith("memopt_nb."):
                out.append((t, id(node) in inside, node.lineno))
    return out


def _layer(module: str) -> tuple[int, str]:
    parts = module.split(".")
    if len(parts) < 2 or parts[1] not in LAYERS:
        return FACADE, "facade"
    return LAYERS[parts[1]], parts[1]


GRAPH = {_module_name(p): _imports(p) for p in sorted(PACKAGE.rglob("*.py"))}


def test_every_module_belongs_to_a_layer():
    loose = [m for m in GRAPH if _layer(m)[1] == "facade" and m not in ("memopt_nb", "memopt_nb.__main__")]
    assert loose == [], f"modules outside the layers: {loose}"


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_no_upward_or_sideways_import(module):
    rank, layer = _layer(module)
    bad = []
    for target, _, line in GRAPH[module]:
        t_rank, t_layer = _layer(target)
        if t_layer == layer:
            continue
        if t_rank >= rank:
            bad.append(f"line {line}: {target} ({t_layer}) from {layer}")
    assert bad == [], f"{module} imports above or beside its layer: {bad}"


def test_no_lazy_import_of_the_package_below_the_facade():
    """Imports inside functions hide an arrow from the graph; the layers make them unnecessary."""
    lazy = [f"{m}:{line} {t}" for m, deps in GRAPH.items() if _layer(m)[0] < FACADE
            for t, inside, line in deps if inside]
    assert lazy == []


def test_no_import_circle():
    graph = {m: {t if t in GRAPH else t.rpartition(".")[0] for t, _, _ in deps} - {m} for m, deps in GRAPH.items()}
    # a package's __init__ that re-exports its own modules is not a circle with them
    graph = {m: {t for t in ts if not (m.startswith(t + ".") and _layer(t)[1] == _layer(m)[1])}
             for m, ts in graph.items()}
    seen: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        seen[m] = 1
        stack.append(m)
        for t in sorted(graph.get(m, ())):
            if seen.get(t) == 1:
                raise AssertionError("import circle: " + " -> ".join(stack[stack.index(t):] + [t]))
            if t not in seen:
                visit(t)
        stack.pop()
        seen[m] = 2

    for m in sorted(graph):
        if m not in seen:
            visit(m)


def test_old_import_paths_still_work():
    """Paths users had before the layers: ``memopt_nb.core.plan``, ``memopt_nb.profiling.profile``,
    ``memopt_nb.planners``."""
    import memopt_nb as memopt
    from memopt_nb.core.plan import Decision, Plan
    from memopt_nb.planners import min_peak, optimal
    from memopt_nb.profiling.profile import ModelProfile, UnitProfile, profile

    assert Plan is memopt.Plan and Decision is memopt.Decision
    assert ModelProfile is memopt.ModelProfile and UnitProfile is memopt.UnitProfile and profile is memopt.profile
    assert callable(min_peak) and callable(optimal) and memopt.solvers.optimal is optimal
    assert callable(memopt.plan) and callable(memopt.profile)  # still the functions, not the modules


def test_the_readmes_old_module_paths_import():
    """README: "old imports memopt_nb.plan, .profile, .solvers still work" — as modules that hold what they held."""
    import importlib

    import memopt_nb as memopt

    assert importlib.import_module("memopt_nb.plan").Plan is memopt.Plan
    assert importlib.import_module("memopt_nb.profile").ModelProfile is memopt.ModelProfile
    assert importlib.import_module("memopt_nb.solvers").optimal is memopt.solvers.optimal


def test_no_test_module_imports_another():
    """What test modules share lives in ``tests/helpers/``: a test module importing another would run that module's
    top level (and share its caches), so a result could depend on which test module was imported first."""
    tests = PACKAGE.parent / "tests"
    found = []
    for path in sorted(tests.glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.name}:{node.lineno} imports {n}" for n in names if n.split(".")[0].startswith("test_")]
    for path in sorted((tests / "helpers").glob("*.py")):
        found += [f"helpers/{path.name}:{m.start()} imports {m.group(1)}"
                  for m in re.finditer(r"^\s*(?:from|import) (test_\w+)", path.read_text(), flags=re.M)]
    assert found == []
