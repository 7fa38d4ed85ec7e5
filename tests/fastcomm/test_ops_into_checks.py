"""The ``residual_source`` and ``*_into`` ops' argument checks and opcheck (their results: test_ops_into.py).

Run under FASTCOMM_NO_NATIVE=1 as well (``make test`` does).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from fastcomm import ops
from fastcomm import reference as ref

sys.path.insert(0, str(Path(__file__).parent))
from _op_inputs import randn as _randn  # noqa: E402

_U8 = torch.uint8


@pytest.mark.parametrize(
    "call,exc,words",
    [
        (
            lambda: ops.quantize_blockwise(torch.randn(8), residual_source=torch.zeros(8)),
            ValueError,
            ("residual_source", "residual"),
        ),
        (
            lambda: ops.sign_compress(torch.randn(8), residual_source=torch.zeros(8)),
            ValueError,
            ("residual_source", "residual"),
        ),
        (
            lambda: ops.topk_select(torch.randn(8), 2, residual_source=torch.randn(8)),
            ValueError,
            ("residual_source", "residual"),
        ),
        (
            lambda: ops.quantize_blockwise(
                torch.randn(8), residual=torch.zeros(8), residual_source=torch.zeros(9)
            ),
            ValueError,
            ("residual_source",),
        ),
        (
            lambda: ops.topk_select(torch.randn(8), 2, torch.randn(8), residual_source=torch.randn(9)),
            ValueError,
            ("residual_source",),
        ),
        (
            lambda: ops.topk_select(torch.randn(8), 2, torch.randn(8), residual_source=torch.randn(8).half()),
            ValueError,
            ("residual_source",),
        ),
        (
            lambda: ops.topk_select(torch.randn(8), 2, torch.randn(8), residual_source=torch.ones(8).int()),
            TypeError,
            ("residual_source",),
        ),
        (
            lambda: ops.sign_compress(torch.randn(8), torch.zeros(8), residual_source=torch.zeros(8).half()),
            ValueError,
            ("residual_source",),
        ),
        (
            lambda: ops.sign_compress(torch.randn(8), torch.zeros(8), residual_source=torch.zeros(8).int()),
            TypeError,
            ("residual_source",),
        ),
        (
            lambda: ops.dequantize_blockwise_into(
                torch.zeros(8, 2).t(), torch.zeros(16, dtype=_U8), torch.ones(1)
            ),
            ValueError,
            ("out",),
        ),
        (
            lambda: ops.dequantize_blockwise_into(
                torch.zeros(8).double(), torch.zeros(8, dtype=_U8), torch.ones(1)
            ),
            TypeError,
            ("out",),
        ),
        (
            lambda: ops.dequantize_blockwise_into(
                torch.zeros(8), torch.zeros(3, dtype=_U8), torch.ones(1), bits=4
            ),
            ValueError,
            ("codes",),
        ),
        (
            lambda: ops.dequantize_blockwise_into(torch.zeros(8), torch.zeros(8), torch.ones(1)),
            TypeError,
            ("codes",),
        ),
        (
            lambda: ops.dequantize_blockwise_into(
                torch.zeros(8), torch.zeros(8, dtype=_U8), torch.ones(1), block=4
            ),
            ValueError,
            ("scales",),
        ),
        (
            lambda: ops.dequantize_blockwise_into(
                torch.zeros(8), torch.zeros(8, dtype=_U8), torch.ones(1).half()
            ),
            TypeError,
            ("scales",),
        ),
        (
            lambda: ops.dequantize_blockwise_into(
                torch.zeros(8), torch.zeros(8, dtype=_U8), torch.ones(1), bits=3
            ),
            ValueError,
            ("bits",),
        ),
        (
            lambda: ops.dequantize_blockwise_into(
                torch.zeros(8), torch.zeros(8, dtype=_U8), torch.ones(1), block=0
            ),
            ValueError,
            ("block",),
        ),
        (
            lambda: ops.sign_decompress_into(torch.zeros(9), torch.zeros(1, dtype=_U8), torch.ones(1)),
            ValueError,
            ("packed",),
        ),
        (
            lambda: ops.sign_decompress_into(
                torch.zeros(9), torch.zeros(2, dtype=_U8), torch.ones(1), chunk=4
            ),
            ValueError,
            ("scales",),
        ),
        (
            lambda: ops.sign_decompress_into(torch.zeros(4, 4).t(), torch.zeros(2, dtype=_U8), torch.ones(1)),
            ValueError,
            ("out",),
        ),
        (
            lambda: ops.sign_decompress_into(
                torch.zeros(8), torch.zeros(1, dtype=_U8), torch.ones(1), chunk=0
            ),
            ValueError,
            ("chunk",),
        ),
    ],
)
def test_bad_input_names_the_argument(call, exc, words):
    with pytest.raises(exc) as info:
        call()
    for word in words:
        assert f"{word}" in str(info.value), (word, str(info.value))


def test_overlapping_residual_source_is_refused():
    buffer = torch.zeros(20)
    x = torch.randn(10)
    with pytest.raises(ValueError, match="overlap"):
        ops.quantize_blockwise(x, residual=buffer[:10], residual_source=buffer[5:15])
    with pytest.raises(ValueError, match="overlap"):
        ops.sign_compress(x, buffer[::2], residual_source=buffer[1::2])
    with pytest.raises(ValueError, match="overlap"):
        ops.topk_select(x, 3, buffer[:10], residual_source=buffer[9:19])
    with pytest.raises(ValueError, match="overlap"):
        ops.topk_select(x, 3, buffer[::2], exact=False, residual_source=buffer[1::2])
    # Two halves of one buffer (double-buffered residuals) are fine, and so is one tensor passed twice.
    ops.quantize_blockwise(x, residual=buffer[:10], residual_source=buffer[10:])
    ops.sign_compress(x, buffer[:10], residual_source=buffer[:10])
    ops.topk_select(x, 3, buffer[:10], residual_source=buffer[10:])
    ops.topk_select(x, 3, buffer[:10], residual_source=buffer[:10])


def test_native_kernels_check_their_arguments():
    """The raw ops (no wrapper) refuse what the wrappers refuse, with the same exception types."""
    with pytest.raises(ValueError, match="residual_source"):
        torch.ops.fastcomm.quantize_blockwise(torch.randn(8), 8, 256, False, 0, None, torch.zeros(8))
    with pytest.raises(ValueError, match="residual_source"):
        torch.ops.fastcomm.sign_compress(torch.randn(8), None, 2048, torch.zeros(8))
    with pytest.raises(ValueError, match="residual_source"):
        torch.ops.fastcomm.topk_select(torch.randn(8), 2, None, True, torch.randn(8))


# ---------------------------------------------------------------------------------------- opcheck, report
def _opcheck_cases():
    x = _randn(1031, torch.float32, "cpu", 15)
    codes, scales = ref.quantize_blockwise(x, 4, 64)
    packed, sign_scales = ref.sign_compress(x, chunk=128)
    return [
        ("quantize_blockwise", (x, 8, 64, True, 3, torch.zeros_like(x), x.clone() * 0.1)),
        ("quantize_blockwise", (x, 2, 7, False, 3, torch.zeros_like(x), x.clone() * 0.1)),
        ("sign_compress", (x, torch.zeros_like(x), 128, x.clone() * 0.1)),
        ("topk_select", (x, 50, _randn(1031, torch.float32, "cpu", 16), True, x.clone() * 0.1)),
        ("dequantize_blockwise_into", (torch.zeros(1031), codes, scales, 4, 64, False)),
        ("dequantize_blockwise_into", (torch.ones(1031, dtype=torch.bfloat16), codes, scales, 4, 64, True)),
        ("sign_decompress_into", (torch.zeros(1031), packed, sign_scales, 128, True)),
    ]


@pytest.mark.parametrize("name,args", _opcheck_cases(), ids=lambda v: v if isinstance(v, str) else "")
def test_opcheck(name, args):
    torch.library.opcheck(getattr(torch.ops.fastcomm, name).default, args)


def test_opcheck_approximate_topk_residual_source():
    x = _randn(300_001, torch.float32, "cpu", 17)
    residual, source = _randn(300_001, torch.float32, "cpu", 18), _randn(300_001, torch.float32, "cpu", 19)
    # Data-dependent output size: check schema and fake kernel, not AOT's static-shape tracing.
    torch.library.opcheck(
        torch.ops.fastcomm.topk_select.default,
        (x, 1000, residual, False, source),
        test_utils=("test_schema", "test_faketensor"),
    )
