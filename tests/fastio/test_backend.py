"""fastio._native: the backend choice (a built extension is used, never skipped silently); it serves no
names of the modules that call the kernels (fastio._mapped, fastio._gather, fastio.format.tar.scan)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import fastio
from fastio import _native


@pytest.mark.skipif(os.environ.get("FASTIO_NO_NATIVE") == "1", reason="FASTIO_NO_NATIVE=1 is set")
def test_a_built_extension_is_loaded():
    built = list(Path(fastio.__file__).parent.glob("_C.*"))
    if not built:
        pytest.skip("fastio._C is not built in place")
    assert _native.native(), fastio.backend()
    assert fastio.backend().startswith("native:")


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'gather_everything'"):
        _native.gather_everything  # noqa: B018
