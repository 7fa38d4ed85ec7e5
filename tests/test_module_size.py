"""No module grows past 500 lines: not in fastcomm or fastio, and not among the benchmarks, the examples, the
tests' helper modules or the test files (tests/**/test_*.py) either. A file that long holds more than one job:
split it along its seams (see STYLE.md "One job per file"); a test file into files of one theme each, with
what they share in a tests/<folder>/_<name>.py helper module rather than copied."""

from __future__ import annotations

import pathlib

import pytest

import fastcomm
import fastio

MAX_LINES = 500
PACKAGE_ROOTS = [pathlib.Path(package.__file__).parent for package in (fastcomm, fastio)]
REPO_ROOT = PACKAGE_ROOTS[0].parent  # both packages are installed from this checkout
TESTS = REPO_ROOT / "tests"
# What the repository runs besides the packages: benchmark scripts and their helpers, the examples, and the
# tests' shared modules (workers, harnesses, fixtures), which are code the tests import, and the test files.
SCRIPT_GROUPS = {
    "benchmarks": sorted((REPO_ROOT / "benchmarks").glob("*.py")),
    "examples": sorted((REPO_ROOT / "examples").glob("*.py")),
    "tests helpers": sorted([*TESTS.rglob("_*.py"), *TESTS.rglob("conftest.py")]),
    "test files": sorted(TESTS.rglob("test_*.py")),
}
PACKAGE_MODULES = [path for root in PACKAGE_ROOTS for path in root.rglob("*.py")]
MODULES = sorted({*PACKAGE_MODULES, *(path for group in SCRIPT_GROUPS.values() for path in group)})


@pytest.mark.parametrize("root", PACKAGE_ROOTS, ids=lambda root: root.name)
def test_the_package_has_modules(root):
    assert len(list(root.rglob("*.py"))) > 10


@pytest.mark.parametrize("group", sorted(SCRIPT_GROUPS))
def test_each_checked_folder_has_modules(group):
    # A moved folder would leave its group empty, and its files unchecked.
    assert len(SCRIPT_GROUPS[group]) >= 2, group


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.relative_to(REPO_ROOT).as_posix())
def test_module_is_at_most_500_lines(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path}: {lines} lines (at most {MAX_LINES})"
