"""fastio._native: the backend choice (a built extension is used, never skipped silently) and the names it
still serves for the modules the kernels' callers moved to."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import fastio
from fastio import _gather, _mapped, _native
from fastio.format import tarscan


@pytest.mark.skipif(os.environ.get("FASTIO_NO_NATIVE") == "1", reason="FASTIO_NO_NATIVE=1 is set")
def test_a_built_extension_is_loaded():
    built = list(Path(fastio.__file__).parent.glob("_C.*"))
    if not built:
        pytest.skip("fastio._C is not built in place")
    assert _native.native(), fastio.backend()
    assert fastio.backend().startswith("native:")


@pytest.mark.parametrize(
    "name,module",
    [
        ("MappedFile", _mapped),
        ("MappedTable", _mapped),
        ("gather_rows", _gather),
        ("gather_ranges", _gather),
        ("read_ranges", _gather),
        ("read_chunks", _gather),
        ("scan_tar", tarscan),
        ("TarScan", tarscan),
        ("_scan_tar_reference", tarscan),
    ],
)
def test_moved_names_still_resolve_from_native(name, module):
    assert getattr(_native, name) is getattr(module, name)


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'gather_everything'"):
        _native.gather_everything  # noqa: B018
