"""fastio._native: the backend choice (a built extension is used, never skipped silently), reported as data
(``fastio.backend()``: a ``Backend`` with the fields of ``fastcomm.backend()``'s); it serves no names of the
modules that call the kernels."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import subprocess
import sys
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
    report = fastio.backend()
    assert report.native and report.reason is None
    assert dict(report) == {
        "gather_rows": "native-cpp",
        "gather_ranges": "native-cpp",
        "scan_tar": "native-cpp",
    }
    assert str(report) == "fastio: native C++ (fastio._C): gather_rows, gather_ranges, scan_tar"


def test_the_switch_is_the_reason_and_every_kernel_falls_back():
    script = "import json, fastio; print(json.dumps(fastio.backend().to_dict()))"
    env = {**os.environ, "FASTIO_NO_NATIVE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {
        "package": "fastio",
        "native": False,
        "reason": "FASTIO_NO_NATIVE=1 is set",
        "ops": {"gather_rows": "torch", "gather_ranges": "torch", "scan_tar": "python tarfile"},
    }


def test_the_report_is_data_of_the_same_shape_as_fastcomms():
    import fastcomm

    ours, theirs = fastio.backend(), fastcomm.backend()
    assert type(ours).__name__ == type(theirs).__name__ == "Backend"
    assert [f.name for f in dataclasses.fields(ours)] == [f.name for f in dataclasses.fields(theirs)]
    assert (ours.package, theirs.package) == ("fastio", "fastcomm")
    assert pickle.loads(pickle.dumps(ours)) == ours
    assert json.loads(json.dumps(ours.to_dict()))["ops"] == dict(ours)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ours.native = False  # type: ignore[misc]


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'gather_everything'"):
        _native.gather_everything  # noqa: B018
