"""fastio's modules import one another without a circle, counting imports inside functions (one moved
into a function to dodge a circle keeps the circle) and under ``TYPE_CHECKING``; the remote layer reaches no
format module, and the native backend none of the modules that call it."""

from __future__ import annotations

import ast
import pathlib

import fastio

PACKAGE_ROOT = pathlib.Path(fastio.__file__).parent
# Compiled from csrc/io (absent when built with FASTIO_NO_NATIVE=1); it imports no Python module.
NATIVE_MODULES = {"fastio._C"}


def _module_files(root: pathlib.Path = PACKAGE_ROOT) -> dict[str, pathlib.Path]:
    files = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        files[".".join(parts)] = path
    return files


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, known: set[str]) -> set[str]:
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in known}
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    found = set()
    for alias in node.names:
        # `from pkg import name` imports the submodule pkg.name when there is one.
        submodule = f"{target}.{alias.name}"
        if submodule in known:
            found.add(submodule)
        elif target in known:
            found.add(target)
    return found


def import_graph(root: pathlib.Path = PACKAGE_ROOT) -> dict[str, set[str]]:
    """Each module of the package at ``root`` (fastio) -> the package's modules it imports anywhere in its
    body."""
    files = _module_files(root)
    known = set(files) | NATIVE_MODULES
    graph: dict[str, set[str]] = {name: set() for name in NATIVE_MODULES}
    for module, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        edges = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges |= _imported(node, module, path.name == "__init__.py", known)
        edges.discard(module)
        graph[module] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            cycle = visit(start)
            if cycle:
                return cycle
    return None


def test_find_cycle_reports_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_graph_sees_function_level_and_submodule_imports():
    graph = import_graph()
    assert "fastio._native" in graph["fastio.format.tar.scan"]  # `from fastio import _native`
    assert "fastio._mapped" in graph["fastio.sources.base"]  # imported under TYPE_CHECKING


def test_graph_sees_an_import_inside_a_function(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from pkg import b\n    return b\n")
    (package / "b.py").write_text("from . import a\n")
    graph = import_graph(package)
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.a"}
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.a"]


def test_fastio_has_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def _reached(graph: dict[str, set[str]], start: set[str]) -> set[str]:
    seen, todo = set(start), list(start)
    while todo:
        for nxt in graph[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_the_remote_layer_knows_no_format():
    graph = import_graph()
    remote = {m for m in graph if m == "fastio.remote" or m.startswith("fastio.remote.")}
    formats = sorted(m for m in _reached(graph, remote) if m.startswith("fastio.format"))
    assert not formats, f"fastio.remote imports (through its imports) {formats}"


def test_the_native_backend_imports_none_of_its_callers():
    reached = _reached(import_graph(), {"fastio._native"})
    assert reached == {"fastio._native", "fastio._C"}, sorted(reached)
