"""fastio's modules import one another without a circle, counting imports inside functions (one moved
into a function to dodge a circle keeps the circle), under ``TYPE_CHECKING``, by name (a table's
``"module:function"`` opener, imported at its first use) and the package ``__init__`` that importing a
module runs first; the remote layer reaches no format module and names no format, and the native backend
imports none of the modules that call it."""

from __future__ import annotations

import ast
import pathlib
import re

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


_NAMED_OPENER = re.compile(r"([A-Za-z_][\w.]*):[A-Za-z_]\w*")


def _named(node: ast.Constant, known: set[str]) -> set[str]:
    """A string ``"package.module:function"`` naming a module of the package: an import at first use."""
    match = _NAMED_OPENER.fullmatch(node.value) if isinstance(node.value, str) else None
    return {match.group(1)} & known if match else set()


def _with_packages(edges: set[str], module: str, known: set[str]) -> set[str]:
    """``edges`` and the packages above each: importing ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__``
    first, except the packages ``module`` itself lies in (they are running already)."""
    out = set(edges)
    for target in edges:
        parts = target.split(".")
        for end in range(1, len(parts)):
            package = ".".join(parts[:end])
            if package in known and not module.startswith(package + "."):
                out.add(package)
    return out


def import_graph(root: pathlib.Path = PACKAGE_ROOT) -> dict[str, set[str]]:
    """Each module of the package at ``root`` (fastio) -> the package's modules it imports anywhere in its
    body, by an import statement or by a ``"module:function"`` name, with the packages they run first."""
    files = _module_files(root)
    known = set(files) | NATIVE_MODULES
    graph: dict[str, set[str]] = {name: set() for name in NATIVE_MODULES}
    for module, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        edges = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges |= _imported(node, module, path.name == "__init__.py", known)
            elif isinstance(node, ast.Constant):
                edges |= _named(node, known)
        edges = _with_packages(edges, module, known)
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
    assert "fastio.files.mapped" in graph["fastio.sources.base"]  # imported under TYPE_CHECKING


def test_graph_sees_an_import_inside_a_function(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("def f():\n    from pkg import b\n    return b\n")
    (package / "b.py").write_text("from . import a\n")
    graph = import_graph(package)
    assert graph["pkg.a"] == {"pkg.b"} and graph["pkg.b"] == {"pkg.a"}
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.a"]


def _package(tmp_path: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    package = tmp_path / "pkg"
    for name, text in files.items():
        path = package / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return package


def test_graph_sees_a_circle_through_an_import_inside_a_function(tmp_path):
    # The shape of a mixing source that opens its streams through the registry while the registry, at its
    # first use, imports the mixing source: a circle however late either import runs.
    package = _package(tmp_path, {
        "__init__.py": "",
        "registry.py": "def open_source(target):\n    from pkg.mixing import source\n    return source\n",
        "mixing/__init__.py": "",
        "mixing/source.py": "from pkg.registry import open_source\n",
    })  # fmt: skip
    cycle = find_cycle(import_graph(package))
    assert cycle == ["pkg.mixing.source", "pkg.registry", "pkg.mixing.source"]


def test_graph_sees_a_module_named_in_a_table(tmp_path):
    package = _package(tmp_path, {
        "__init__.py": "",
        "registry.py": "OPENERS = {'tar': 'pkg.tar:open_tar'}\n",
        "tar.py": "import typing\nif typing.TYPE_CHECKING:\n    from pkg.registry import OPENERS\n",
    })  # fmt: skip
    graph = import_graph(package)
    assert graph["pkg.registry"] == {"pkg.tar"}
    assert find_cycle(graph) == ["pkg.registry", "pkg.tar", "pkg.registry"]


def test_graph_sees_the_package_init_an_import_runs_first(tmp_path):
    package = _package(tmp_path, {
        "__init__.py": "",
        "registry.py": "from pkg.sources.base import Source\n",
        "sources/__init__.py": "from pkg.registry import open_source\n",
        "sources/base.py": "class Source: ...\n",
    })  # fmt: skip
    graph = import_graph(package)
    assert graph["pkg.registry"] == {"pkg.sources", "pkg.sources.base"}
    assert graph["pkg.sources.base"] == set()  # its own package is running already
    assert find_cycle(graph) == ["pkg.registry", "pkg.sources", "pkg.registry"]


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


# A format's names: its file suffixes and sidecars, its folder. fastio.remote moves and keeps bytes; what a
# format keeps beside a shard (a sidecar suffix) or checks in it, the format's remote source passes in.
_FORMAT_WORDS = re.compile(
    r"\.fidx|\.tar\b|\btars?\b|meta\.json|index\.json|\.fio\b|webdataset|fastio\.format|\.npy\b|gzip|zstd|\.tgz",
    re.IGNORECASE,
)


def test_the_remote_layer_names_no_format():
    found = [
        f"{path.relative_to(PACKAGE_ROOT.parent)}:{number}: {line.strip()}"
        for path in sorted((PACKAGE_ROOT / "remote").rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if _FORMAT_WORDS.search(line)
    ]
    assert not found, "fastio.remote names a format:\n" + "\n".join(found)


def test_the_format_words_are_found():
    named = ('Path(f"{data}.fidx")', "a tar's index", "x.meta.json", "fastio.format.tar.remote")
    assert all(_FORMAT_WORDS.search(text) for text in named)
    assert not _FORMAT_WORDS.search("a shard's sidecars, started at the target")


def test_the_native_backend_imports_none_of_its_callers():
    reached = _reached(import_graph(), {"fastio._native"})
    assert reached == {"fastio._native", "fastio._C"}, sorted(reached)
