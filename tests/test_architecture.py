"""The package's layers (docs/architecture.md): imports run downward only, no circles, no
module longer than 500 lines, no function longer than 60 lines in the layers that run ops.

Every ``import`` and ``from ... import`` in the package counts, the ones inside functions
too: a lazy import is still a dependency, only a hidden one.
"""

from __future__ import annotations

import ast
import pathlib
from typing import Dict, List, Set

import pytest

import torchTensorRef

ROOT = pathlib.Path(torchTensorRef.__file__).parent
PACKAGE = "torchTensorRef"

#: bottom to top; a module may import its own layer's modules and the layers below
LAYERS = ("core", "strategies", "analysis", "memory", "ops", "regions", "integrations", "")
MAX_LINES = 500
#: the layers whose functions run on every op or region call, kept short enough to read whole
SHORT_FUNCTION_LAYERS = ("memory", "ops", "regions")
MAX_FUNCTION_LINES = 60


def _module_name(path: pathlib.Path) -> str:
    parts = (PACKAGE,) + path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> Dict[str, pathlib.Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _imports(name: str, path: pathlib.Path, modules) -> Set[str]:
    """The package's modules that ``name`` imports, anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                if f"{source}.{alias.name}" in modules:
                    found.add(f"{source}.{alias.name}")  # a module imported from its package
                elif source in modules:
                    found.add(source)
    found.discard(name)
    return {m for m in found if m == PACKAGE or m.startswith(PACKAGE + ".")}


def _layer(name: str) -> int:
    parts = name.split(".")
    top = parts[1] if len(parts) > 1 and parts[1] in LAYERS else ""
    return LAYERS.index(top)


GRAPH = {name: _imports(name, path, _modules()) for name, path in _modules().items()}


def _cycles(graph) -> List[List[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_module_is_in_a_layer():
    for name in GRAPH:
        parts = name.split(".")
        assert len(parts) <= 2 or parts[1] in LAYERS, f"{name} is in no layer of {LAYERS}"


def test_no_import_circles():
    assert _cycles(GRAPH) == []


def test_the_cycle_check_finds_a_circle():
    # (the check itself: a graph with a circle a -> b -> c -> a and a tail d -> a)
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_imports_run_downward_only():
    upward = [f"{name} ({LAYERS[_layer(name)] or 'top'}) imports {other} ({LAYERS[_layer(other)] or 'top'})"
              for name, imported in sorted(GRAPH.items()) for other in sorted(imported)
              if _layer(other) > _layer(name)]
    assert upward == []


def test_the_graph_sees_lazy_imports():
    # ops.dispatch binds itself on TensorRef; the core must not import it, even inside a function
    assert "torchTensorRef.core.tensor_ref" in GRAPH["torchTensorRef.ops.dispatch"]
    assert "torchTensorRef.memory.sim.device" in GRAPH["torchTensorRef.integrations.plain"]


@pytest.mark.parametrize("name", sorted(GRAPH))
def test_no_module_is_longer_than_500_lines(name):
    lines = len(_modules()[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{name} has {lines} lines"


def _functions(path: pathlib.Path):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node.lineno, node.end_lineno - node.lineno + 1


@pytest.mark.parametrize("layer", SHORT_FUNCTION_LAYERS)
def test_no_function_is_longer_than_60_lines_in_the_layers_that_run_ops(layer):
    long = [f"{path.relative_to(ROOT)}:{line} {name} ({n} lines)"
            for path in sorted((ROOT / layer).rglob("*.py")) for name, line, n in _functions(path)
            if n > MAX_FUNCTION_LINES]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines in {layer}/: {long}"


def test_the_function_length_check_counts_decorators_out_and_the_body_in(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("@staticmethod\ndef f():\n" + "    x = 1\n" * 61 + "\n\nasync def g():\n    pass\n")
    assert list(_functions(path)) == [("f", 2, 62), ("g", 66, 2)]


def test_the_public_names_are_importable_from_the_package():
    for name in torchTensorRef.__all__:
        assert getattr(torchTensorRef, name) is not None, name
    from torchTensorRef.strategies import DEFAULT, NAMES, Flow, Genoa, Strategy, by_name  # noqa: F401


def test_the_architecture_page_names_every_layer_and_module():
    page = (ROOT.parent / "docs" / "architecture.md").read_text()
    missing = [name for name in GRAPH if name.rpartition(".")[2] not in page]
    assert missing == [], "docs/architecture.md does not name these modules"
    assert all(f"{layer}/" in page for layer in LAYERS if layer)


def test_the_module_paths_the_documentation_names_still_import():
    # (after the move into layers, ``from torchTensorRef.sizes import ...`` raised ModuleNotFoundError)
    import importlib

    for name, module in torchTensorRef.PUBLIC_MODULES.items():
        assert importlib.import_module(f"torchTensorRef.{name}") is module
        assert getattr(torchTensorRef, name) is module
    from torchTensorRef.sizes import format_size, parse_size  # noqa: F401
    from torchTensorRef.timeline import predict  # noqa: F401
    from torchTensorRef.compiler import FullGraphError  # noqa: F401
    from torchTensorRef.patching import CREATION_FUNCTIONS  # noqa: F401


# -- private names stay in the module that defines them ----------------------------------

#: private names of torch's that the package reads on torch's objects (not the package's own)
TORCH_PRIVATES = {"_is_param": "torch marks an instance of a Parameter subclass with it"}


def _private_definitions(tree: ast.AST) -> Set[str]:
    """Private names a module defines: ``self._x = ...`` (or ``cls.``), class-level names and
    ``__slots__``, functions and classes, module-level assignments."""
    found: Set[str] = set()

    def private(name) -> bool:
        return isinstance(name, str) and name.startswith("_") and not name.startswith("__")

    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name)
                and node.value.id in ("self", "cls") and private(node.attr)):
            found.add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and private(node.name):
            found.add(node.name)
        elif isinstance(node, (ast.Module, ast.ClassDef)):
            for stmt in node.body:
                targets = stmt.targets if isinstance(stmt, ast.Assign) else (
                    [stmt.target] if isinstance(stmt, ast.AnnAssign) else [])
                for target in targets:
                    if isinstance(target, ast.Name) and private(target.id):
                        found.add(target.id)
                    if (isinstance(target, ast.Name) and target.id == "__slots__"
                            and isinstance(stmt.value, (ast.Tuple, ast.List))):
                        found.update(e.value for e in stmt.value.elts
                                     if isinstance(e, ast.Constant) and private(e.value))
    return found


def _private_uses(tree: ast.AST):
    """(name, line, what) of private attributes read or written, and private names imported
    from the package's modules; attributes of torch's own objects are left out."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            receiver = ast.unparse(node.value)
            if not receiver.startswith("torch.") and receiver != "torch":
                yield node.attr, node.lineno, f"{receiver}.{node.attr}"
        elif isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith(PACKAGE)):
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    yield alias.name, node.lineno, f"import {alias.name}"


def _private_accesses(sources: Dict[str, str]) -> List[str]:
    """Private names of the package's modules used outside the module that defines them."""
    trees = {name: ast.parse(text) for name, text in sources.items()}
    defined = {name: _private_definitions(tree) for name, tree in trees.items()}
    owners: Dict[str, Set[str]] = {}
    for name, names in defined.items():
        for private in names:
            owners.setdefault(private, set()).add(name)
    found = []
    for name, tree in trees.items():
        for private, line, what in _private_uses(tree):
            if private in defined[name] or private in TORCH_PRIVATES or private not in owners:
                continue
            found.append(f"{name}:{line} {what} (defined in {', '.join(sorted(owners[private]))})")
    return found


def test_no_private_name_is_used_outside_the_module_that_defines_it():
    # A private name read from another module is an import the import graph cannot see: the
    # manager's parts, the strategies' parts and the layers above reach each other through
    # public methods and attributes only (docs/architecture.md)
    sources = {name: path.read_text() for name, path in _modules().items()}
    assert _private_accesses(sources) == []


def test_the_private_name_check_finds_reads_writes_and_imports():
    sources = {
        "pkg.a": "class A:\n    def __init__(self):\n        self._state = 0\n\ndef _helper():\n    pass\n",
        "pkg.b": ("from .a import _helper\n\ndef f(a):\n    a._state += 1\n    return torch._C._state, a.public\n"),
    }
    found = sorted(f.split(" (")[0] for f in _private_accesses(sources))
    assert found == ["pkg.b:1 import _helper", "pkg.b:4 a._state"]  # (not torch's, not a public name)
