"""No import circles in ``fastcomm``, counting imports inside functions: each module is parsed with ``ast``.

An import moved inside a function to dodge a circle keeps the circle, so every ``import`` statement counts,
wherever it stands (under ``TYPE_CHECKING`` too). ``from a import b`` is an edge to the module ``a.b`` when
there is one, or when ``a/__init__.py`` binds no ``b`` (a compiled submodule such as ``fastcomm._C``, which
is no edge); else an edge to ``a``. Importing ``a.b`` also runs ``a/__init__.py``, but that edge is left
out: every module of a package would otherwise sit in a circle with its ``__init__``, which is what
re-exporting means.

Also checked, in fresh interpreters: what ``import fastcomm.fsdp`` and ``import fastcomm.diloco`` load (not
the DDP hooks); and in both packages, that no exported name hides a submodule of the same name.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import types
from pathlib import Path

import pytest

import fastcomm

PACKAGE_DIR = Path(fastcomm.__file__).parent


def _modules() -> dict[str, Path]:
    """Every module of ``fastcomm`` by dotted name (a package by its own name, for its ``__init__.py``)."""
    modules = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = ("fastcomm", *path.relative_to(PACKAGE_DIR).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _bound_names(tree: ast.Module) -> set[str]:
    """The names a module binds at its top level (imports, definitions, assignments)."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """The dotted names one import statement in ``module`` reaches, submodules resolved."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        anchor = module.split(".")
        anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
        base = ".".join([*anchor, *([base] if base else [])])
    return [f"{base}.{alias.name}" for alias in node.names] + [base]


def import_graph() -> dict[str, set[str]]:
    """``module -> the fastcomm modules it imports``, from every import statement at any depth."""
    modules = _modules()
    trees = {name: ast.parse(path.read_text(), filename=str(path)) for name, path in modules.items()}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, tree in trees.items():
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            targets = _imported(node, name, modules[name].name == "__init__.py")
            if isinstance(node, ast.ImportFrom):
                *members, base = targets
                package = base in modules and modules[base].name == "__init__.py"
                bound = _bound_names(trees[base]) if base in trees else set()
                # `from a import b`: the module a.b, or a submodule the package a does not bind; else a
                targets = [
                    m if m in modules or (package and m.rsplit(".", 1)[1] not in bound) else base
                    for m in members
                ]
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as ``[a, b, ..., a]``, or ``None`` when the graph has none (depth-first search)."""
    done: set[str] = set()
    path: list[str] = []
    on_path: set[str] = set()

    def visit(node: str) -> list[str] | None:
        path.append(node)
        on_path.add(node)
        for target in sorted(graph[node]):
            if target in on_path:
                return [*path[path.index(target) :], target]
            if target not in done:
                cycle = visit(target)
                if cycle is not None:
                    return cycle
        path.pop()
        on_path.discard(node)
        done.add(node)
        return None

    for start in sorted(graph):
        if start not in done:
            cycle = visit(start)
            if cycle is not None:
                return cycle
    return None


def test_the_graph_sees_function_level_and_relative_imports(tmp_path):
    source = "def f():\n    from . import util\n    from fastcomm.hooks.engine.util import BucketKey\n"
    tree = ast.parse(source)
    nodes = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert _imported(nodes[0], "fastcomm.hooks.engine.store", False)[0] == "fastcomm.hooks.engine.util"
    graph = import_graph()
    assert "fastcomm.hooks.engine.util" in graph["fastcomm.hooks.topk"]


def test_find_cycle_names_the_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_fastcomm_has_no_import_circle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


# ------------------------------------------------------------------------- what an import brings in
def _modules_loaded_by(statement: str) -> set[str]:
    """The ``fastcomm`` modules in ``sys.modules`` after ``statement`` in a fresh interpreter."""
    script = (
        f"import sys\n{statement}\n"
        "print('\\n'.join(m for m in sys.modules if m == 'fastcomm' or m.startswith('fastcomm.')))"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return set(done.stdout.split())


@pytest.mark.parametrize("package", ["fastcomm.fsdp", "fastcomm.diloco"])
def test_fsdp_and_diloco_do_not_load_the_ddp_hooks(package):
    # they take their compressors from fastcomm.compress; the hooks (and the advisor they import) stay out
    loaded = _modules_loaded_by(f"import {package}")
    assert package in loaded and "fastcomm.compress.registry" in loaded
    assert not {m for m in loaded if m.startswith(("fastcomm.hooks", "fastcomm.advise"))}


def test_the_hooks_load_on_first_use_of_a_name_they_give():
    loaded = _modules_loaded_by("import fastcomm\nfastcomm.register")
    assert "fastcomm.hooks.registry" in loaded


# ---------------------------------------------------------------------------- names that hide others
def _packages(top: str) -> list[str]:
    root = Path(importlib.import_module(top).__file__).parent
    return [
        ".".join((top, *init.parent.relative_to(root).parts)) for init in sorted(root.rglob("__init__.py"))
    ]


@pytest.mark.parametrize("package", _packages("fastcomm") + _packages("fastio"))
def test_no_exported_name_hides_a_submodule_of_the_same_name(package):
    # `from pkg import x` must not give a function where `import pkg.x` gives a module
    module = importlib.import_module(package)
    folder = Path(module.__file__).parent
    submodules = {p.stem for p in folder.glob("*.py")} | {p.parent.name for p in folder.glob("*/__init__.py")}
    for name in set(getattr(module, "__all__", ())) & submodules:
        value = getattr(module, name)
        assert isinstance(value, types.ModuleType) and value.__name__ == f"{package}.{name}", (
            f"{package}.{name} is a {type(value).__name__}, hiding the module {package}.{name}"
        )
