"""The Triton quantize kernels against ``fastcomm.reference``, bit for bit.

Without CUDA the kernels run on CPU tensors under ``TRITON_INTERPRET=1`` (set by ``tests/conftest.py``), so
sizes stay small; with CUDA the same tests run compiled on ``cuda`` tensors. The reference is always
evaluated on a CPU copy. Every comparison is exact: the kernels perform the reference's single fp32
operations in the same order, so there is no tolerance to derive.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot run")

import fastcomm.ops  # noqa: E402  (declares the fastcomm ops; its table names the Triton rows)
from fastcomm import reference  # noqa: E402
from fastcomm.triton import register_cuda_kernels  # noqa: E402
from fastcomm.triton.quantize import (  # noqa: E402
    dequantize_blockwise,
    dequantize_blockwise_into,
    quantize_blockwise,
)

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered:RuntimeWarning")  # interpreter's numpy on inf

# Compiled kernels need CUDA tensors; without CUDA the interpreter runs them on CPU tensors.
DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]
SIZES = (1, 7, 1000, 4099, 20_011)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
BITS = (8, 4, 2)


def _assert_same_floats(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal bit patterns, except that any NaN matches any NaN (sign and payload are not specified)."""
    actual, expected = actual.cpu(), expected.cpu()
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(actual), nan)
    ints = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[actual.dtype]
    assert torch.equal(actual[~nan].view(ints), expected[~nan].view(ints))


def _check(x: torch.Tensor, bits: int, block: int, stochastic: bool, seed: int = 1234) -> None:
    codes, scales = quantize_blockwise(x, bits, block, stochastic, seed)
    ref_codes, ref_scales = reference.quantize_blockwise(x.cpu(), bits, block, stochastic, seed)
    assert codes.device == x.device
    assert torch.equal(codes.cpu(), ref_codes)
    _assert_same_floats(scales, ref_scales)
    for dtype in DTYPES:
        out = dequantize_blockwise(codes, scales, x.numel(), bits, block, dtype)
        _assert_same_floats(
            out, reference.dequantize_blockwise(ref_codes, ref_scales, x.numel(), bits, block, dtype)
        )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_matches_reference(n: int, dtype: torch.dtype, bits: int, stochastic: bool, device: str) -> None:
    torch.manual_seed(n)
    _check((torch.randn(n) * 3).to(dtype).to(device), bits, 256, stochastic)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("block", [1, 3, 7, 100, 4096, 5000])
def test_block_sizes(block: int, bits: int, device: str) -> None:
    """Blocks that share bytes with their neighbour (not a multiple of 8 / bits) or span several tiles."""
    torch.manual_seed(block)
    _check(torch.randn(4099).to(device), bits, block, stochastic=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_special_blocks(dtype: torch.dtype, bits: int, device: str) -> None:
    """inf/NaN blocks (NaN scale), all-zero blocks, and blocks so small that qmax / absmax overflows."""
    torch.manual_seed(0)
    x = torch.randn(256 * 8)
    x[5] = float("nan")
    x[256 + 9] = float("inf")
    x[512 + 3] = -float("inf")
    x[768:1024] = 0.0
    x[1024:1280] *= 1e-38
    x[1280:1536] *= 1e-44  # subnormal in fp32 and bf16 (zero in fp16)
    x[1280] = 0.0
    x[1536:1792] = torch.finfo(dtype).max
    _check(x.to(dtype).to(device), bits, 256, stochastic=False)
    _check(x.to(dtype).to(device), bits, 256, stochastic=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", [0, 1, 2**31, -1, 2**63 - 1, -(2**63)])
def test_seeds(seed: int, device: str) -> None:
    """The int64 seed is folded to 32 bits exactly as the reference folds it."""
    _check(torch.randn(1000).to(device), 4, 64, stochastic=True, seed=seed)


@pytest.mark.parametrize("device", DEVICES)
def test_non_contiguous_input(device: str) -> None:
    x = torch.randn(64, 63).to(device).t()[:, ::2]
    assert not x.is_contiguous()
    _check(x, 4, 100, stochastic=True)


@pytest.mark.parametrize("device", DEVICES)
def test_empty(device: str) -> None:
    codes, scales = quantize_blockwise(torch.empty(0, device=device), 4, 256, False, 0)
    assert codes.shape == (0,) and scales.shape == (0,)
    assert dequantize_blockwise(codes, scales, 0, 4, 256, torch.float16).shape == (0,)


_TRITON_OPS = tuple(spec.name for spec in fastcomm.ops.OP_SPECS if spec.triton)


def test_register_cuda_kernels_registers_every_triton_row() -> None:
    assert _TRITON_OPS  # the table names at least one Triton kernel
    lib = torch.library.Library("fastcomm_triton_test", "DEF")
    for op in _TRITON_OPS:
        schema = getattr(torch.ops.fastcomm, op).default._schema
        lib.define(str(schema).replace("fastcomm::", "", 1))
    register_cuda_kernels(lib, {s.name: s.triton for s in fastcomm.ops.OP_SPECS if s.triton})
    for op in _TRITON_OPS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"fastcomm_triton_test::{op}", "CUDA")


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA: the registered Triton kernels are CUDA-only"
)
def test_opcheck_cuda() -> None:
    x = torch.randn(4099, device="cuda")
    torch.library.opcheck(torch.ops.fastcomm.quantize_blockwise, (x, 4, 100, True, 7))
    codes, scales = torch.ops.fastcomm.quantize_blockwise(x, 4, 100, True, 7)
    torch.library.opcheck(
        torch.ops.fastcomm.dequantize_blockwise, (codes, scales, 4099, 4, 100, torch.bfloat16)
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", BITS)
def test_quantize_with_residual_matches_reference(device, dtype, bits):
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(4099, generator=g).to(dtype)
    residual = (torch.randn(4099, generator=g) * 0.1).to(dtype)
    residual_ref = residual.clone()
    residual_dev = residual.to(device)
    codes, scales = quantize_blockwise(x.to(device), bits, 256, True, 9, residual=residual_dev)
    codes_ref, scales_ref = reference.quantize_blockwise(x, bits, 256, True, 9, residual=residual_ref)
    assert torch.equal(codes.cpu(), codes_ref)
    _assert_same_floats(scales, scales_ref)
    _assert_same_floats(residual_dev, residual_ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("same", [False, True])
def test_quantize_residual_source_matches_reference(device, bits, same):
    """``residual_source``: the bits of ``residual.copy_(residual_source)`` and the in-place call."""
    g = torch.Generator().manual_seed(10 + bits)
    x = torch.randn(1000, generator=g).to(torch.bfloat16)
    source = (torch.randn(1000, generator=g) * 0.1).to(torch.bfloat16)
    expected = source.clone()
    codes_ref, scales_ref = reference.quantize_blockwise(x, bits, 100, True, 3, residual=expected)
    source_dev = source.to(device)
    residual = source_dev if same else torch.randn(1000).to(torch.bfloat16).to(device)
    codes, scales = quantize_blockwise(x.to(device), bits, 100, True, 3, residual, source_dev)
    assert torch.equal(codes.cpu(), codes_ref)
    _assert_same_floats(scales, scales_ref)
    _assert_same_floats(residual, expected)
    if not same:
        _assert_same_floats(source_dev, source)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("accumulate", [False, True])
def test_dequantize_into_matches_reference(device, bits, dtype, accumulate):
    """Decoded into a caller's buffer (overwritten, or added to in fp32), from a longer payload."""
    g = torch.Generator().manual_seed(bits)
    n, block = 999, 100
    codes, scales = reference.quantize_blockwise(torch.randn(n, generator=g), bits, block, True, 1)
    long_codes = torch.cat([codes, torch.full((5,), 255, dtype=torch.uint8)])
    long_scales = torch.cat([scales, torch.full((2,), float("nan"))])
    out = torch.randn(n, generator=g).to(dtype).view(333, 3)
    expected = out.clone()
    reference.dequantize_blockwise_into(expected, long_codes, long_scales, bits, block, accumulate)
    out_dev = out.to(device)
    dequantize_blockwise_into(out_dev, long_codes.to(device), long_scales.to(device), bits, block, accumulate)
    _assert_same_floats(out_dev, expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", [8, 2])
@pytest.mark.parametrize("block", [7, 5000])
def test_fused_residual_across_block_layouts(device, bits, block):
    """Error feedback fused into blocks that share bytes (7) or span several column tiles (5000), with a
    strided residual (updated through a contiguous copy) and a separate source."""
    g = torch.Generator().manual_seed(block * bits)
    x = torch.randn(4099, generator=g).to(torch.float16)
    source = (torch.randn(4099, generator=g) * 0.1).to(torch.float16)
    expected = source.clone()
    codes_ref, scales_ref = reference.quantize_blockwise(x, bits, block, True, 5, residual=expected)
    residual = torch.zeros(2, 4099, dtype=torch.float16, device=device)[1]
    strided = torch.zeros(4099 * 2, dtype=torch.float16, device=device)[::2]
    for target in (residual, strided):
        codes, scales = quantize_blockwise(x.to(device), bits, block, True, 5, target, source.to(device))
        assert torch.equal(codes.cpu(), codes_ref)
        _assert_same_floats(scales, scales_ref)
        _assert_same_floats(target, expected)
