"""The package's import graph: imports point down the layer list only, and no circle exists.

Every module of ``placement`` is parsed (imports inside functions and ``TYPE_CHECKING`` blocks
included) and each ``placement.*`` import is checked against the layer order below, which
``docs/layout.md`` and ``placement/__init__``'s docstring describe. No two modules import each
other, directly or around a circle, in ``placement`` or in ``benchmarks``; modules of both stay
under 600 lines.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import networkx as nx
import pytest

import placement

ROOT = Path(placement.__file__).parent
BENCHMARKS = ROOT.parent / "benchmarks"

# Lowest first. A module may import its own layer and any layer before it.
LAYERS = [
    "errors",
    "graph",
    "analysis",
    "passes",
    "planning",
    "lowering",
    "runtime",
    "generation",
    "distributed",
    "report",
    "launch",
    "demo",
    "cli",
]
# Top-level modules that are not layers: the package root re-exports every layer lazily,
# and the zoo (placement.models) is data for examples and tests, importing only the root.
EXEMPT = {"__init__", "models"}
# Entry points above every layer: they may use the root's public names (``import placement as pl``).
TOP = {"launch", "demo", "cli"}


def _layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _modules(root: Path = ROOT) -> dict[str, Path]:
    found = {}
    for path in root.rglob("*.py"):
        rel = path.relative_to(root.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _type_checking_only(tree: ast.Module) -> set[int]:
    """Ids of the nodes inside ``if TYPE_CHECKING:`` blocks (imports for annotations only)."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) in {"TYPE_CHECKING", "typing.TYPE_CHECKING"}:
            for statement in node.body:
                inside.update(id(sub) for sub in ast.walk(statement))
    return inside


def _imports(module: str, path: Path, *, type_checking: bool = True, top: str = "placement") -> set[str]:
    """Every ``top...`` module named by an import in ``path`` (lazy imports included;
    those under ``if TYPE_CHECKING:`` only when ``type_checking``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return _imports_of_tree(module, path, tree, type_checking=type_checking, top=top)


def _imports_of_tree(
    module: str, path: Path, tree: ast.Module, *, type_checking: bool, top: str = "placement"
) -> set[str]:
    """:func:`_imports` of an already parsed module."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    skip = set() if type_checking else _type_checking_only(tree)
    names: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            names.add(target)
            names.update(f"{target}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module":
            if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                names.add(node.args[0].value)
    return {name for name in names if name == top or name.startswith(top + ".")}


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """The longest known module that ``name`` denotes (``from x import f`` names ``x.f``)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def test_every_layer_is_known() -> None:
    tops = {_layer_of(m) for m in _modules()} - EXEMPT
    assert tops <= set(LAYERS), f"modules outside the layer list: {sorted(tops - set(LAYERS))}"


def test_imports_point_down_only() -> None:
    modules = _modules()
    rank = {layer: i for i, layer in enumerate(LAYERS)}
    upward = []
    for module, path in sorted(modules.items()):
        layer = _layer_of(module)
        if layer in EXEMPT:
            continue
        for name in _imports(module, path):
            target = _known(name, modules)
            if target is None or target == "placement":
                if target == "placement" and layer not in TOP:
                    # the root re-exports every layer, so importing it from inside is importing upward
                    upward.append(f"{module} -> placement (import a layer module instead)")
                continue
            other = _layer_of(target)
            if other == "models":
                continue
            if rank[other] > rank[layer]:
                upward.append(f"{module} -> {target}")
    assert not upward, "imports pointing up the layer list:\n" + "\n".join(upward)


# The two runtimes sit side by side: neither imports the other (what they share is in runtime/).
SIDE_BY_SIDE = ("placement.runtime.ort", "placement.runtime.torch")


def test_runtimes_side_by_side() -> None:
    modules = _modules()
    crossing = []
    for module, path in sorted(modules.items()):
        for own, other in (SIDE_BY_SIDE, SIDE_BY_SIDE[::-1]):
            if module == own or module.startswith(own + "."):
                for name in _imports(module, path):
                    target = _known(name, modules) or ""
                    if target == other or target.startswith(other + "."):
                        crossing.append(f"{module} -> {target}")
    assert not crossing, "one runtime imports the other:\n" + "\n".join(crossing)


def _unit(module: str, modules: dict[str, Path]) -> str:
    """The package a module belongs to; a top-level module (``placement.demo``) is its own unit."""
    if modules[module].name == "__init__.py" or module.count(".") == 1:
        return module
    return module.rpartition(".")[0]


def test_no_package_circles() -> None:
    modules = _modules()
    graph = nx.DiGraph()
    for module, path in modules.items():
        if module == "placement" or _layer_of(module) == "models":
            continue
        for name in _imports(module, path):
            target = _known(name, modules)
            if target is None or target == "placement" or _layer_of(target) == "models":
                continue
            source_unit, target_unit = _unit(module, modules), _unit(target, modules)
            if source_unit != target_unit and not source_unit.startswith(target_unit + "."):
                graph.add_edge(source_unit, target_unit)
    cycles = [c for c in nx.simple_cycles(graph) if len(c) > 1]
    assert not cycles, f"package import cycles: {cycles}"


def _module_graph() -> nx.DiGraph:
    """Module -> module imports across the whole package, subpackages and their ``__init__``
    included (module- and function-level imports, ``TYPE_CHECKING``-only ones too: a type that
    two modules need lives in the lower one, or in a structural type of its own)."""
    modules = _modules()
    graph = nx.DiGraph()
    for module, path in modules.items():
        if module == "placement" or _layer_of(module) == "models":
            continue
        for name in _imports(module, path):
            target = _known(name, modules)
            if target is None or target == module or target == "placement":
                continue
            graph.add_edge(module, target)
    return graph


def test_no_module_circles() -> None:
    graph = _module_graph()
    cycles = sorted(sorted(c) for c in nx.simple_cycles(graph))
    assert not cycles, f"module import circles: {cycles}"


def _benchmark_graph() -> nx.DiGraph:
    """Module -> module imports between the benchmarks (lazy and ``TYPE_CHECKING`` ones too)."""
    modules = _modules(BENCHMARKS)
    graph = nx.DiGraph()
    for module, path in modules.items():
        graph.add_node(module)
        for name in _imports(module, path, top="benchmarks"):
            target = _known(name, modules)
            if target is not None and target not in (module, "benchmarks"):
                graph.add_edge(module, target)
    return graph


def test_benchmarks_are_a_package_without_circles() -> None:
    assert (BENCHMARKS / "__init__.py").is_file()
    graph = _benchmark_graph()
    assert "benchmarks.harness" in graph and graph.in_degree("benchmarks.harness") > 5, "one shared harness"
    cycles = sorted(sorted(c) for c in nx.simple_cycles(graph))
    assert not cycles, f"benchmark import circles: {cycles}"


def test_benchmark_modules_are_under_600_lines() -> None:
    long = {
        module: count
        for module, path in _modules(BENCHMARKS).items()
        if (count := len(path.read_text().splitlines())) >= MAX_MODULE_LINES
    }
    assert not long, f"benchmark modules of {MAX_MODULE_LINES} lines or more (split them): {long}"


def test_a_type_checking_import_closes_a_circle() -> None:
    """The walk sees imports under ``if TYPE_CHECKING:`` and inside functions."""
    tree = ast.parse(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from placement.graph.model import Model\n"
        "def f():\n    from placement.graph.views import op_graph\n"
    )
    path = ROOT / "graph" / "saving.py"
    seen = _imports_of_tree("placement.graph.saving", path, tree, type_checking=True)
    assert {"placement.graph.model", "placement.graph.views.op_graph"} <= seen


@pytest.mark.parametrize("name", ["torch", "onnxruntime", "onnx_ir"])
def test_import_placement_is_light(name: str) -> None:
    import subprocess
    import sys

    code = f"import sys, placement; sys.exit(1 if {name!r} in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0, f"`import placement` loaded {name}"


# Size limits: a module is one concern a reader can hold; a function one job. Exceptions are for
# tables only (a long literal mapping or list), each named here with the reason; none today.
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 100
LONG_MODULES: dict[str, str] = {}  # module -> why it is a table
LONG_FUNCTIONS: dict[str, str] = {}  # "module:qualified.name" -> why it is a table
Function = ast.FunctionDef | ast.AsyncFunctionDef


def test_modules_are_under_600_lines() -> None:
    long = {
        module: count
        for module, path in _modules().items()
        if (count := len(path.read_text().splitlines())) >= MAX_MODULE_LINES and module not in LONG_MODULES
    }
    assert not long, f"modules of {MAX_MODULE_LINES} lines or more (split them by concern): {long}"


def _code_lines(function: Function) -> int:
    """Lines from the first statement after the docstring to the end of the last statement."""
    body = function.body
    if len(body) > 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        if isinstance(body[0].value.value, str):
            body = body[1:]
    return (body[-1].end_lineno or body[-1].lineno) - body[0].lineno + 1


def _functions(tree: ast.AST, prefix: str = "") -> Iterator[tuple[str, Function]]:
    """Every function and method of ``tree`` (nested ones included) with its qualified name."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node
            yield from _functions(node, prefix + node.name + ".")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, prefix + node.name + ".")
        else:
            yield from _functions(node, prefix)


def test_functions_are_at_most_100_lines_of_code() -> None:
    long = {}
    for module, path in sorted(_modules().items()):
        tree = ast.parse(path.read_text(), filename=str(path))
        for name, function in _functions(tree):
            key = f"{module}:{name}"
            if (count := _code_lines(function)) > MAX_FUNCTION_LINES and key not in LONG_FUNCTIONS:
                long[key] = count
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines of code (split them): {long}"


def test_function_size_counts_code_after_the_docstring() -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES + 1))
    tree = ast.parse(f'def f():\n    """Doc."""\n{body}\n\n\ndef g():\n    """Doc."""\n    return 1\n')
    counts = {name: _code_lines(function) for name, function in _functions(tree)}
    assert counts == {"f": MAX_FUNCTION_LINES + 1, "g": 1}
