"""The Triton sign-compression kernels against ``fastcomm.reference``.

Without CUDA the kernels run on CPU tensors under ``TRITON_INTERPRET=1`` (set by ``tests/conftest.py``); with
CUDA the same tests run compiled on ``cuda`` tensors. The reference is always evaluated on a CPU copy.

Sign bits are compared exactly. The scale is ``mean |acc|`` summed in float64 and rounded to fp32 once: the
float64 sums of the kernel (a tree) and of torch (its own blocking) can differ in their last float64 bits,
which moves the fp32 rounding by at most one fp32 ulp, and only when the exact mean lies within about
``chunk * 2**-53`` (relative) of an fp32 rounding boundary. So scales may differ by one ulp, and the residual
is held exactly to the reference's formula applied to the kernel's own scales (equal to the reference
whenever the scales are).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot run")

from fastcomm import reference  # noqa: E402
from fastcomm.triton.sign import sign_compress, sign_decompress, sign_decompress_into  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered:RuntimeWarning")  # interpreter's numpy on inf

DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]
SIZES = (1, 7, 1000, 4099, 20_011)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _assert_within_one_ulp(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Non-negative fp32 scales: bit patterns at most one apart, NaN where the reference has NaN."""
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(actual), nan)
    gap = (actual[~nan].view(torch.int32).long() - expected[~nan].view(torch.int32).long()).abs()
    assert gap.numel() == 0 or int(gap.max()) <= 1


def _assert_same_floats(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal bit patterns, except that any NaN matches any NaN (sign and payload are not specified)."""
    nan = torch.isnan(expected)
    assert actual.dtype == expected.dtype and torch.equal(torch.isnan(actual), nan)
    ints = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}[actual.dtype]
    assert torch.equal(actual[~nan].view(ints), expected[~nan].view(ints))


def _check(x: torch.Tensor, residual: torch.Tensor | None, chunk: int) -> None:
    ref_residual = residual.cpu().clone() if residual is not None else None
    before = residual.clone() if residual is not None else None
    packed, scales = sign_compress(x, residual, chunk)
    ref_packed, ref_scales = reference.sign_compress(x.cpu(), ref_residual, chunk)
    assert torch.equal(packed.cpu(), ref_packed)
    _assert_within_one_ulp(scales.cpu(), ref_scales)
    if residual is not None:
        # The reference's residual formula evaluated with the kernel's scales: must match bit for bit.
        acc = (x.cpu().reshape(-1) + before.cpu().reshape(-1)).float()
        chunk_of = torch.arange(acc.numel()) // chunk
        sent = torch.where(acc >= 0, scales.cpu()[chunk_of], -scales.cpu()[chunk_of])
        _assert_same_floats(residual.cpu().reshape(-1), (acc - sent).to(x.dtype))
        if torch.equal(scales.cpu(), ref_scales):
            _assert_same_floats(residual.cpu(), ref_residual)
    for dtype in DTYPES:
        out = sign_decompress(packed, scales, x.numel(), chunk, dtype)
        _assert_same_floats(
            out.cpu(), reference.sign_decompress(packed.cpu(), scales.cpu(), x.numel(), chunk, dtype)
        )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_matches_reference(n: int, dtype: torch.dtype, with_residual: bool, device: str) -> None:
    torch.manual_seed(n)
    x = torch.randn(n).to(dtype).to(device)
    residual = (torch.randn(n) * 0.5).to(dtype).to(device) if with_residual else None
    _check(x, residual, 2048)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chunk", [1, 7, 100, 4096, 5000])
def test_chunk_sizes(chunk: int, device: str) -> None:
    """Chunks that share bytes with their neighbour (not a multiple of 8) or span several tiles."""
    torch.manual_seed(chunk)
    _check(torch.randn(4099).to(device), torch.randn(4099).to(device), chunk)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_special_values(dtype: torch.dtype, device: str) -> None:
    """Signed zeros (``-0.0 >= 0`` sends +scale), NaN and inf chunks, all-zero chunks."""
    x = torch.randn(64 * 6)
    x[0:64] = 0.0
    x[1] = -0.0
    x[64 + 3] = float("nan")
    x[128 + 5] = float("inf")
    x[192:256] = -0.0
    _check(x.to(dtype).to(device), torch.zeros(x.numel(), dtype=dtype, device=device), 64)
    _check(x.to(dtype).to(device), None, 64)


@pytest.mark.parametrize("device", DEVICES)
def test_non_contiguous_input_and_residual(device: str) -> None:
    torch.manual_seed(3)
    x = torch.randn(70, 40).to(device).t()
    residual = torch.randn(70, 40).to(device).t()
    assert not x.is_contiguous() and not residual.is_contiguous()
    _check(x, residual, 100)


@pytest.mark.parametrize("device", DEVICES)
def test_empty(device: str) -> None:
    packed, scales = sign_compress(torch.empty(0, device=device), torch.empty(0, device=device), 2048)
    assert packed.shape == (0,) and scales.shape == (0,)
    assert sign_decompress(packed, scales, 0, 2048, torch.bfloat16).shape == (0,)


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA: the registered Triton kernels are CUDA-only"
)
def test_opcheck_cuda() -> None:
    import fastcomm.ops  # noqa: F401  (declares the ops)

    x = torch.randn(4099, device="cuda")
    torch.library.opcheck(torch.ops.fastcomm.sign_compress, (x, torch.zeros_like(x), 100))
    packed, scales = torch.ops.fastcomm.sign_compress(x, None, 100)
    torch.library.opcheck(torch.ops.fastcomm.sign_decompress, (packed, scales, 4099, 100, torch.float16))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("same", [False, True])
def test_residual_source_is_copy_then_in_place(device: str, same: bool) -> None:
    torch.manual_seed(5)
    x = torch.randn(4099).to(device)
    source = torch.randn(4099).to(device)
    expected = source.clone()
    packed_ip, scales_ip = sign_compress(x, expected, 100)
    residual = source if same else torch.randn(4099).to(device)
    before = source.clone()
    packed, scales = sign_compress(x, residual, 100, residual_source=source)
    assert torch.equal(packed.cpu(), packed_ip.cpu())
    _assert_same_floats(scales.cpu(), scales_ip.cpu())
    _assert_same_floats(residual.cpu(), expected.cpu())
    if not same:
        _assert_same_floats(source.cpu(), before.cpu())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("accumulate", [False, True])
def test_decompress_into_matches_reference(device: str, dtype: torch.dtype, accumulate: bool) -> None:
    torch.manual_seed(6)
    n, chunk = 1001, 100
    packed, scales = reference.sign_compress(torch.randn(n), chunk=chunk)
    long_packed = torch.cat([packed, torch.full((3,), 255, dtype=torch.uint8)])
    long_scales = torch.cat([scales, torch.full((2,), float("nan"))])
    out = torch.randn(n).to(dtype).view(143, 7)
    expected = out.clone()
    reference.sign_decompress_into(expected, long_packed, long_scales, chunk, accumulate)
    out_dev = out.to(device)
    sign_decompress_into(out_dev, long_packed.to(device), long_scales.to(device), chunk, accumulate)
    _assert_same_floats(out_dev.cpu(), expected)
