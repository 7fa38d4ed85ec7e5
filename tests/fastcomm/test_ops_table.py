"""fastcomm's op table: every op registered and opcheck'd, arguments checked by name, and backend() reporting.

The kernels' results against fastcomm.reference are in test_ops.py; this file holds what does not depend on
the values: schemas, fake kernels, argument errors and the report of which implementation each op runs on.
Run under FASTCOMM_NO_NATIVE=1 as well (``make test`` does).
"""

from __future__ import annotations

import inspect
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fastcomm
from fastcomm import ops
from fastcomm import reference as ref

sys.path.insert(0, str(Path(__file__).parent))
from _op_inputs import randn as _randn  # noqa: E402


def _opcheck_cases():
    x = _randn(1031, torch.float32, "cpu", 15)
    codes, scales = ref.quantize_blockwise(x, 4, 64)
    packed, sign_scales = ref.sign_compress(x, chunk=128)
    w = _randn(1100, torch.float32, "cpu", 16)
    return [
        ("topk_select", (x, 50, x.clone() * 0.1, True)),
        ("quantize_blockwise", (x, 4, 64, True, 3, None)),
        ("quantize_blockwise", (x, 8, 64, True, 3, x.clone() * 0.1)),
        ("dequantize_blockwise", (codes, scales, 1031, 4, 64, torch.float16)),
        ("sign_compress", (x, x.clone() * 0.1, 128)),
        ("sign_decompress", (packed, sign_scales, 1031, 128, torch.float32)),
        ("sparse_accumulate", (x.clone(), torch.tensor([3, 3, 1000], dtype=torch.int32), torch.ones(3))),
        ("sparse_mean", (x.clone(), torch.tensor([3, 3, 1000], dtype=torch.int32), x[:3].clone(), 2, None)),
        ("sparse_mean", (x.clone(), torch.tensor([5, 1030]), x[:2].clone(), 3, torch.tensor([3, 5]).int())),
        # test_ops_into.py checks these two further (accumulating, other dtypes, padded payloads).
        ("dequantize_blockwise_into", (torch.zeros(1031), codes, scales, 4, 64, False)),
        ("sign_decompress_into", (torch.zeros(1031), packed, sign_scales, 128, False)),
        # test_ops_powersgd.py checks these three further (ranks, strides, both loop builds, streaming).
        (
            "powersgd_project",
            (
                torch.empty(37, 3),
                torch.empty(37, 29),
                w[:87].view(3, 29).clone(),
                w[:1073].view(37, 29).clone(),
                w[1:1074].view(37, 29) * 0.1,
            ),
        ),
        ("powersgd_back_project", (torch.empty(3, 29), w[:111].view(37, 3).clone(), w[:1073].view(37, 29))),
        (
            "powersgd_expand",
            (
                torch.empty(37, 29),
                w[:111].view(37, 3).clone(),
                w[:87].view(3, 29).clone(),
                w[:1073].view(37, 29).clone(),
            ),
        ),
    ]


@pytest.mark.parametrize("name,args", _opcheck_cases(), ids=lambda v: v if isinstance(v, str) else "")
def test_opcheck(name, args):
    torch.library.opcheck(getattr(torch.ops.fastcomm, name).default, args)


def test_opcheck_approximate_topk_dynamic_size():
    x = _randn(300000, torch.float32, "cpu", 16)
    # Data-dependent output size: check schema and fake kernel, not AOT's static-shape tracing.
    torch.library.opcheck(
        torch.ops.fastcomm.topk_select.default,
        (x, 1000, None, False),
        test_utils=("test_schema", "test_faketensor"),
    )


@pytest.mark.parametrize(
    "call,exc,word",
    [
        (lambda: ops.topk_select(torch.arange(10), 2), TypeError, "x"),
        (lambda: ops.topk_select(torch.randn(10), 11), ValueError, "k"),
        (lambda: ops.topk_select(torch.randn(10), -1), ValueError, "k"),
        (lambda: ops.topk_select(torch.randn(10), 2, torch.zeros(9)), ValueError, "residual"),
        (
            lambda: ops.topk_select(torch.randn(10), 2, torch.zeros(10, dtype=torch.float16)),
            ValueError,
            "residual",
        ),
        (lambda: ops.quantize_blockwise(torch.randn(10), bits=3), ValueError, "bits"),
        (lambda: ops.quantize_blockwise(torch.randn(10), block=0), ValueError, "block"),
        (lambda: ops.quantize_blockwise(torch.randn(10).double()), TypeError, "x"),
        (lambda: ops.quantize_blockwise(torch.randn(10), residual=torch.zeros(5)), ValueError, "residual"),
        (
            lambda: ops.dequantize_blockwise(torch.zeros(3, dtype=torch.uint8), torch.ones(1), 10),
            ValueError,
            "codes",
        ),
        (lambda: ops.dequantize_blockwise(torch.zeros(10), torch.ones(1), 10), TypeError, "codes"),
        (lambda: ops.sign_compress(torch.randn(10), chunk=-2), ValueError, "chunk"),
        (
            lambda: ops.sign_decompress(torch.zeros(2, dtype=torch.uint8), torch.ones(2), 10),
            ValueError,
            "scales",
        ),
        (
            lambda: ops.sparse_accumulate(torch.zeros(4), torch.tensor([4]), torch.ones(1)),
            ValueError,
            "indices",
        ),
        (
            lambda: ops.sparse_accumulate(torch.zeros(4), torch.tensor([1.0]), torch.ones(1)),
            TypeError,
            "indices",
        ),
        (
            lambda: ops.sparse_mean(torch.zeros(4), torch.tensor([1]), torch.ones(1), 0),
            ValueError,
            "world_size",
        ),
        (
            lambda: ops.sparse_mean(torch.zeros(4), torch.tensor([1]), torch.ones(1), 2, torch.tensor([9])),
            ValueError,
            "clear",
        ),
        (
            lambda: ops.sparse_mean(torch.zeros(4), torch.tensor([1]), torch.ones(1), 2, clear=torch.ones(1)),
            TypeError,
            "clear",
        ),
    ],
)
def test_bad_input_names_the_argument(call, exc, word):
    with pytest.raises(exc, match=rf"\b{word}\b"):
        call()


# ---------------------------------------------------------------------------------------- the op table
@pytest.mark.parametrize("spec", ops.OP_SPECS, ids=lambda spec: spec.name)
def test_every_table_row_is_registered(spec):
    op = getattr(torch.ops.fastcomm, spec.name).default
    assert op._schema == torch._C.parse_schema(spec.qualname + spec.schema)
    assert torch._C._dispatch_has_kernel_for_dispatch_key(spec.qualname, "CompositeExplicitAutograd")
    # Only register_fake installs a Meta kernel (fastcomm._C registers CPU and CUDA ones).
    assert torch._C._dispatch_has_kernel_for_dispatch_key(spec.qualname, "Meta")
    assert spec.name in ops.__all__ and callable(getattr(ops, spec.name))


@pytest.mark.parametrize("spec", ops.OP_SPECS, ids=lambda spec: spec.name)
def test_public_op_states_its_schema_arguments(spec):
    """The reference twin is the one Python home of an op's signature: it must match the schema's."""
    public, twin = getattr(ops, spec.name), getattr(ref, spec.name)
    assert inspect.signature(public) == inspect.signature(twin) and public.__doc__ == twin.__doc__
    params = inspect.signature(public).parameters
    arguments = getattr(torch.ops.fastcomm, spec.name).default._schema.arguments
    assert list(params) == [argument.name for argument in arguments]
    for argument in arguments:
        default = params[argument.name].default
        if not argument.has_default_value():
            assert default is inspect.Parameter.empty, argument.name
        elif isinstance(default, torch.dtype):  # the schema holds a dtype default as a ScalarType number
            assert argument.default_value == 6 and default == torch.float32, argument.name  # 6: Float
        else:
            assert default == argument.default_value, argument.name


def test_in_place_ops_return_out():
    out = torch.zeros(10)
    assert ops.sparse_accumulate(out, torch.tensor([3]), torch.ones(1)) is out
    codes, scales = ops.quantize_blockwise(_randn(10, torch.float32, "cpu", 7), bits=4)
    assert ops.dequantize_blockwise_into(out, codes, scales, bits=4, accumulate=True) is out
    packed, scales = ops.sign_compress(_randn(10, torch.float32, "cpu", 8))
    assert ops.sign_decompress_into(out, packed, scales) is out


def test_op_names_come_from_the_table():
    assert ops.OP_NAMES == tuple(spec.name for spec in ops.OP_SPECS)
    assert len(set(ops.OP_NAMES)) == len(ops.OP_NAMES)


def test_opcheck_covers_every_op():
    assert {name for name, _ in _opcheck_cases()} == set(ops.OP_NAMES)


def test_triton_rows_register_their_host_functions():
    pytest.importorskip("triton", reason="triton is not installed: no Triton kernels to register")
    from fastcomm.triton import register_cuda_kernels

    lib = torch.library.Library("fastcomm_table_test", "DEF")
    try:
        for spec in ops.OP_SPECS:
            lib.define(spec.name + spec.schema)
        register_cuda_kernels(lib, {s.name: s.triton for s in ops.OP_SPECS if s.triton})
        for spec in ops.OP_SPECS:
            qualname = f"fastcomm_table_test::{spec.name}"
            has_cuda = torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "CUDA")
            assert has_cuda == (spec.triton is not None), spec.name
    finally:
        lib._destroy()


# ------------------------------------------------------------------------------------------------ backend()
def _check_device_entry(entry: ops.DeviceBackend, device: str) -> None:
    assert entry.device == device
    assert (entry.implementation == "reference") == (entry.reason is not None)


def test_backend_reports_every_op_with_its_implementation_and_why():
    report = fastcomm.backend()
    assert list(report) == list(ops.OP_NAMES)
    for entry in report.values():
        assert isinstance(entry, ops.OpBackend)
        _check_device_entry(entry.cpu, "cpu")
        _check_device_entry(entry.cuda, "cuda")
        if ops.native_error() is None:
            assert entry.cpu.implementation == "native-cpp"
            assert entry.cpu.threads >= 1 and entry.cpu.isa in ("avx2", "baseline")
        else:
            assert entry.cpu.implementation == "reference" and entry.cpu.reason == ops.native_error()
        if not torch.cuda.is_available():
            assert entry.cuda == ops.DeviceBackend("cuda", "reference", reason="no CUDA device")
    assert pickle.loads(pickle.dumps(report)) == report


def test_backend_round_trips_through_json():
    report = fastcomm.backend()
    loaded = json.loads(json.dumps({op: entry.to_dict() for op, entry in report.items()}))
    rebuilt = {
        op: ops.OpBackend(ops.DeviceBackend(**entry["cpu"]), ops.DeviceBackend(**entry["cuda"]))
        for op, entry in loaded.items()
    }
    assert rebuilt == report


def test_backend_without_native_kernels_says_they_were_disabled():
    if os.environ.get("FASTCOMM_NO_NATIVE") == "1":  # `make test`'s fallback pass: this process is the case
        report = json.loads(json.dumps({o: e.to_dict() for o, e in fastcomm.backend().items()}))
    else:
        script = (
            "import json, fastcomm; "
            "print(json.dumps({o: e.to_dict() for o, e in fastcomm.backend().items()}))"
        )
        env = {**os.environ, "FASTCOMM_NO_NATIVE": "1"}
        done = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout)
    assert list(report) == list(ops.OP_NAMES)
    for entry in report.values():
        assert entry["cpu"]["implementation"] == "reference"
        assert entry["cpu"]["reason"] == "disabled by FASTCOMM_NO_NATIVE=1"


@pytest.mark.parametrize(
    "entry,prose",
    [
        (
            ops.OpBackend(
                ops.DeviceBackend("cpu", "native-cpp", threads=2, isa="avx2"),
                ops.DeviceBackend("cuda", "reference", reason="no CUDA device"),
            ),
            "cpu: native C++ (OpenMP, 2 threads, avx2 loops); cuda: reference (no CUDA device)",
        ),
        (
            ops.OpBackend(
                ops.DeviceBackend("cpu", "reference", reason="disabled by FASTCOMM_NO_NATIVE=1"),
                ops.DeviceBackend("cuda", "triton"),
            ),
            "cpu: reference (disabled by FASTCOMM_NO_NATIVE=1); cuda: triton",
        ),
        (
            ops.OpBackend(ops.DeviceBackend("cpu", "native-cpp"), ops.DeviceBackend("cuda", "cuda-cpp")),
            "cpu: native C++; cuda: native CUDA C++",
        ),
    ],
    ids=["native-cpu", "reference-cpu", "no-detail"],
)
def test_backend_entry_prints_as_prose(entry, prose):
    assert str(entry) == prose


@pytest.mark.parametrize(
    "kwargs,word",
    [
        ({"implementation": "reference"}, "reason"),
        ({"implementation": "triton", "reason": "why not"}, "reason"),
        ({"implementation": "opencl"}, "implementation"),
    ],
    ids=["reference-without-reason", "reason-without-reference", "unknown-implementation"],
)
def test_device_backend_refuses_inconsistent_fields(kwargs, word):
    with pytest.raises(ValueError, match=rf"\b{word}\b"):
        ops.DeviceBackend("cpu", **kwargs)
