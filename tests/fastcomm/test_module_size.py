"""No module of fastcomm grows past 500 lines: a file that long holds more than one job (split it along its
seams, see STYLE.md "One job per file")."""

from __future__ import annotations

import pathlib

import pytest

import fastcomm

MAX_LINES = 500
PACKAGE_ROOT = pathlib.Path(fastcomm.__file__).parent
MODULES = sorted(PACKAGE_ROOT.rglob("*.py"))


def test_the_package_has_modules():
    assert len(MODULES) > 10


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.relative_to(PACKAGE_ROOT.parent).as_posix())
def test_module_is_at_most_500_lines(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path}: {lines} lines (at most {MAX_LINES})"
