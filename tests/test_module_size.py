"""No module of fastcomm or fastio grows past 500 lines: a file that long holds more than one job (split it
along its seams, see STYLE.md "One job per file")."""

from __future__ import annotations

import pathlib

import pytest

import fastcomm
import fastio

MAX_LINES = 500
PACKAGE_ROOTS = [pathlib.Path(package.__file__).parent for package in (fastcomm, fastio)]
MODULES = sorted(path for root in PACKAGE_ROOTS for path in root.rglob("*.py"))
REPO_ROOT = PACKAGE_ROOTS[0].parent  # both packages are installed from this checkout


@pytest.mark.parametrize("root", PACKAGE_ROOTS, ids=lambda root: root.name)
def test_the_package_has_modules(root):
    assert len(list(root.rglob("*.py"))) > 10


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.relative_to(REPO_ROOT).as_posix())
def test_module_is_at_most_500_lines(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path}: {lines} lines (at most {MAX_LINES})"
