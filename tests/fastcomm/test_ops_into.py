"""``residual_source`` and the ``*_into`` decompression ops, on every device here, against fastcomm.reference.

The specification of each feature is a composition of existing ops, and the tests hold every backend to it
bit for bit:

* ``quantize_blockwise(x, ..., residual=r, residual_source=s)`` is ``r.copy_(s)`` followed by the in-place
  call, and ``s`` is left as it was. Likewise for ``sign_compress`` and ``topk_select``.
* ``dequantize_blockwise_into(out, codes, scales, ...)`` is ``out.copy_(dequantize_blockwise(codes[:need],
  ...))``; with ``accumulate=True`` it is ``(out.float() + dequantized_fp32).to(out.dtype)``. Likewise for
  ``sign_compress`` and ``sign_decompress_into``.

The one tolerance is sign_compress's scale against the reference (an fp64 sum in another order: one fp32
ulp, as in test_ops.py); the native ``residual_source`` form is still compared bit for bit with the native
in-place form. Native CPU kernels run in both of their builds (AVX2 and baseline) where the machine has AVX2.
Run under FASTCOMM_NO_NATIVE=1 as well (``make test`` does): the checks then exercise the reference.
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

import pytest
import torch

from fastcomm import ops
from fastcomm import reference as ref

sys.path.insert(0, str(Path(__file__).parent))
from _op_inputs import DEVICES, DTYPES  # noqa: E402
from _op_inputs import randn as _randn

SIZES = [1, 7, 255, 257, 4099, 100_003]
# 300_001 is large enough that approximate top-k samples its threshold at k = 1% and n / 3 (not the exact
# fallback), so the vector loops of both modes run; 65_537 leaves a tail after the last full vector.
TOPK_SIZES = [1, 7, 1000, 65_537]
# (kind, n, exact): every kind, size and mode, and at 300_001 every kind in the sampled (approximate) mode
# and the heavy-tailed and non-finite inputs in the exact one (exact ties across selection ranges are at
# 65_537 already). 300_001 is marked `large`: `make test`'s FASTCOMM_NO_NATIVE=1 pass leaves it out, since
# the op under test is the reference there.
TOPK_CASES = [
    (kind, n, exact) for kind in ("randn", "ties", "nonfinite") for n in TOPK_SIZES for exact in (True, False)
]
TOPK_CASES += [
    pytest.param(kind, 300_001, exact, marks=pytest.mark.large, id=f"{kind}-300001-{exact}")
    for kind, exact in (
        ("randn", True),
        ("randn", False),
        ("ties", False),
        ("nonfinite", True),
        ("nonfinite", False),
    )
]
BITS = [8, 4, 2]
EPS32 = 2.0**-23
_INTS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def _native():
    if ops.native_error() is not None:
        return None
    from fastcomm import _C

    return _C


# The native CPU loops exist in an AVX2 build and a baseline build; both run here when the machine has AVX2.
_NATIVE = _native()
ISAS = ["default"] + (["baseline"] if _NATIVE is not None and _NATIVE.cpu_isa() == "avx2" else [])


@pytest.fixture(params=ISAS)
def isa(request):
    """Runs a test with the native CPU kernels' default build of their loops, then with the baseline build."""
    if request.param == "baseline":
        _NATIVE._set_avx2(False)
    yield request.param
    if _NATIVE is not None:
        _NATIVE._set_avx2(True)


def _shaped(t: torch.Tensor) -> torch.Tensor:
    """A 2-D view where the size allows, since only numel counts."""
    n = t.numel()
    return t.view(n // 3, 3) if n % 3 == 0 and n > 3 else t


def _assert_same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal bit patterns (any NaN matches any NaN)."""
    actual, expected = actual.cpu().reshape(-1), expected.cpu().reshape(-1)
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if actual.dtype not in _INTS:
        assert torch.equal(actual, expected)
        return
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(actual), nan)
    assert torch.equal(actual[~nan].view(_INTS[actual.dtype]), expected[~nan].view(_INTS[actual.dtype]))


def _padded(t: torch.Tensor, extra: int, seed: int) -> torch.Tensor:
    """``t`` followed by ``extra`` random elements, which the ``*_into`` ops must ignore."""
    g = torch.Generator().manual_seed(seed)
    tail = torch.randint(0, 256, (extra,), generator=g, dtype=torch.uint8).to(t.dtype)
    return torch.cat([t.reshape(-1), tail.to(t.device)])


# ------------------------------------------------------------------------------------------ residual_source
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("bits", BITS)
def test_quantize_residual_source(isa, device, dtype, n, bits):
    x = _shaped(_randn(n, dtype, device, n + bits))
    source = _shaped(_randn(n, dtype, device, n + bits + 1, 0.1))
    source_before = source.clone()
    for block, stochastic in ((256, True), (256, False), (7, True)):
        residual = _shaped(_randn(n, dtype, device, n + block))  # stale values: overwritten, never read
        codes, scales = ops.quantize_blockwise(x, bits, block, stochastic, 11, residual, source)
        expected = source.cpu().clone()  # the specification: residual.copy_(source), then in place
        codes_ref, scales_ref = ref.quantize_blockwise(
            x.cpu(), bits, block, stochastic, 11, residual=expected
        )
        _assert_same(codes, codes_ref)
        _assert_same(scales, scales_ref)
        _assert_same(residual, expected)
        _assert_same(source, source_before)
        # The reference's own residual_source path, and residual_source=residual (the in-place form).
        stale = residual.cpu().clone()
        ref_out = ref.quantize_blockwise(x.cpu(), bits, block, stochastic, 11, stale, source.cpu())
        _assert_same(ref_out[0], codes_ref)
        _assert_same(stale, expected)
        same = source.clone()
        ops.quantize_blockwise(x, bits, block, stochastic, 11, residual=same, residual_source=same)
        _assert_same(same, expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_sign_residual_source(isa, device, dtype, n):
    x = _shaped(_randn(n, dtype, device, n))
    source = _shaped(_randn(n, dtype, device, n + 1, 0.5))
    source_before = source.clone()
    for chunk in (2048, 5, 64):
        residual = _shaped(_randn(n, dtype, device, n + chunk))
        packed, scales = ops.sign_compress(x, residual, chunk, residual_source=source)
        _assert_same(source, source_before)
        # Bit for bit the same backend's copy-then-in-place result.
        in_place = source.clone()
        packed_ip, scales_ip = ops.sign_compress(x, in_place, chunk)
        _assert_same(packed, packed_ip)
        _assert_same(scales, scales_ip)
        _assert_same(residual, in_place)
        same = source.clone()
        ops.sign_compress(x, same, chunk, residual_source=same)
        _assert_same(same, in_place)
        # Against the reference: bits exact, scales within one ulp (fp64 sums in another order).
        expected = source.cpu().clone()
        packed_ref, scales_ref = ref.sign_compress(x.cpu(), expected, chunk)
        stale = residual.cpu().clone()
        ref_out = ref.sign_compress(x.cpu(), stale, chunk, residual_source=source.cpu())
        _assert_same(ref_out[0], packed_ref)
        _assert_same(stale, expected)
        _assert_same(packed, packed_ref)
        torch.testing.assert_close(scales.cpu(), scales_ref, rtol=EPS32, atol=0)
        if torch.equal(scales.cpu(), scales_ref):
            _assert_same(residual, expected)


# ---------------------------------------------------------------------------------------------- *_into ops
def _check_decode_into(dtype, device, n, seed, decode, op_into, ref_into):
    """``op_into(out, accumulate=)`` (the op) and ``ref_into`` (its twin) against ``decode(dtype)`` (the plain
    decoder): overwriting, and adding in fp32 rounded once (for fp32 exactly ``out.add_(decoded)``)."""
    for accumulate in (False, True):
        out = _shaped(_randn(n, dtype, device, seed))
        before = out.cpu().clone()
        if accumulate:
            decoded = decode(torch.float32)
            expected = (before.reshape(-1).float() + decoded).to(dtype)
        else:
            expected = decode(dtype)
        result = op_into(out, accumulate=accumulate)
        assert result is out and out.shape == before.shape
        _assert_same(out, expected)
        again = before.clone()
        ref_into(again, accumulate=accumulate)
        _assert_same(again, expected)
        if accumulate and dtype == torch.float32:
            _assert_same(out, before.reshape(-1).add_(decoded))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("bits", BITS)
def test_dequantize_into(isa, device, dtype, n, bits):
    x = _randn(n, torch.float32, "cpu", 3 * n + bits)
    for block in (256, 7):
        codes, scales = ref.quantize_blockwise(x, bits, block, True, 5)
        codes_long = _padded(codes, 13, n).to(device)
        scales_long = _padded(scales, 3, n).to(device)
        _check_decode_into(
            dtype,
            device,
            n,
            n + block,
            partial(ref.dequantize_blockwise, codes, scales, n, bits, block),
            partial(
                ops.dequantize_blockwise_into, codes=codes_long, scales=scales_long, bits=bits, block=block
            ),
            partial(
                ref.dequantize_blockwise_into,
                codes=codes_long.cpu(),
                scales=scales_long.cpu(),
                bits=bits,
                block=block,
            ),
        )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_sign_decompress_into(isa, device, dtype, n):
    x = _randn(n, torch.float32, "cpu", 7 * n)
    for chunk in (2048, 5, 64):
        packed, scales = ref.sign_compress(x, chunk=chunk)
        packed_long = _padded(packed, 9, n).to(device)
        scales_long = _padded(scales, 2, n).to(device)
        _check_decode_into(
            dtype,
            device,
            n,
            n + chunk,
            partial(ref.sign_decompress, packed, scales, n, chunk),
            partial(ops.sign_decompress_into, packed=packed_long, scales=scales_long, chunk=chunk),
            partial(
                ref.sign_decompress_into, packed=packed_long.cpu(), scales=scales_long.cpu(), chunk=chunk
            ),
        )


@pytest.mark.parametrize("device", DEVICES)
def test_into_ops_decode_a_padded_payload_into_an_unpadded_bucket(device):
    # What a hook does: quantize a zero-padded bucket, decode the padded payload straight into the bucket.
    n, padded_n = 1000, 1024
    g = _randn(n, torch.float32, device, 1)
    codes, scales = ops.quantize_blockwise(torch.nn.functional.pad(g, (0, padded_n - n)), bits=4, block=128)
    bucket = torch.empty(n, device=device)
    ops.dequantize_blockwise_into(bucket, codes, scales, bits=4, block=128)
    _assert_same(bucket, ops.dequantize_blockwise(codes, scales, padded_n, bits=4, block=128)[:n])
    packed, sign_scales = ops.sign_compress(torch.nn.functional.pad(g, (0, padded_n - n)), chunk=128)
    ops.sign_decompress_into(bucket, packed, sign_scales, chunk=128, accumulate=True)


def test_empty_out_is_a_no_op():
    out = torch.empty(0)
    assert ops.dequantize_blockwise_into(out, torch.empty(0, dtype=torch.uint8), torch.empty(0)) is out
    assert ops.sign_decompress_into(out, torch.empty(0, dtype=torch.uint8), torch.empty(0)) is out


# -------------------------------------------------------------------------------------------- bad inputs
def _topk_inputs(n: int, dtype: torch.dtype, device: str, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, residual_source): heavy-tailed values, or small integers (many ties at the threshold), or values
    with ±inf in both and one NaN. Never two NaNs, nor inf + -inf: the order among NaN keys follows their
    payloads, which torch's own fp16/bf16 arithmetic does not keep the same from one code path to another."""
    if kind == "ties":
        g = torch.Generator().manual_seed(n)
        magnitude = torch.randint(1, 4, (2, n), generator=g).float()
        signs = torch.randint(0, 2, (2, n), generator=g).float() * 2 - 1
        x, source = magnitude[0] * signs[0], magnitude[1] * signs[1] * 0.5
        return _shaped(x.to(dtype).to(device)), _shaped(source.to(dtype).to(device))
    x = _randn(n, dtype, "cpu", n + 3)
    source = _randn(n, dtype, "cpu", n + 4, 0.5)
    if kind == "nonfinite" and n > 10:
        x[3], x[n // 2], x[n - 2] = float("nan"), float("inf"), float("-inf")
        source[5], source[n // 3] = float("inf"), float("-inf")
    return _shaped(x.to(device)), _shaped(source.to(device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("kind", "n", "exact"), TOPK_CASES)
def test_topk_residual_source(isa, device, dtype, kind, n, exact):
    x, source = _topk_inputs(n, dtype, device, kind)
    source_before = source.clone()
    for k in sorted({0, 1, max(1, n // 100), n // 3}):
        residual = _shaped(_randn(n, dtype, device, n + k + 5))  # stale values: overwritten, never read
        values, indices = ops.topk_select(x, k, residual, exact, residual_source=source)
        _assert_same(source, source_before)
        assert indices.dtype == torch.int32 and values.dtype == dtype
        # The specification: residual.copy_(source), then the in-place call.
        expected = source.cpu().clone()
        values_ref, indices_ref = ref.topk_select(x.cpu(), k, expected, exact)
        _assert_same(indices, indices_ref)
        _assert_same(values, values_ref)
        _assert_same(residual, expected)
        # Bit for bit the same backend's copy-then-in-place result, and residual_source=residual.
        in_place = source.clone()
        values_ip, indices_ip = ops.topk_select(x, k, in_place, exact)
        _assert_same(indices, indices_ip)
        _assert_same(values, values_ip)
        _assert_same(in_place, expected)
        same = source.clone()
        ops.topk_select(x, k, same, exact, residual_source=same)
        _assert_same(same, expected)
        # The reference's own residual_source path.
        stale = residual.cpu().clone()
        ref_out = ref.topk_select(x.cpu(), k, stale, exact, residual_source=source.cpu())
        _assert_same(ref_out[1], indices_ref)
        _assert_same(stale, expected)


def test_topk_residual_source_noncontiguous():
    """Strided residual and residual_source: the result is written back into the caller's residual."""
    base = _randn(40_000, torch.float32, "cpu", 21)
    x = base[::2]
    source = _randn(40_000, torch.float32, "cpu", 22, 0.5)[1::2]
    residual_base = _randn(40_000, torch.float32, "cpu", 23)
    residual = residual_base[::2]
    for exact in (True, False):
        values, indices = ops.topk_select(x, 200, residual, exact, residual_source=source)
        expected = source.clone()
        values_ref, indices_ref = ref.topk_select(x.contiguous(), 200, expected, exact)
        _assert_same(indices, indices_ref)
        _assert_same(values, values_ref)
        _assert_same(residual_base[::2], expected)


@pytest.mark.skipif(_NATIVE is None, reason="native kernels not built")
def test_topk_streamed_residual_gives_the_reference_bits():
    """Past 16 MB the approximate pass stores the residual non-temporally: the same bits, aligned or not."""
    n = (16 << 20) // 4 + 1003
    x, source = _randn(n, torch.float32, "cpu", 31), _randn(n, torch.float32, "cpu", 32, 0.1)
    expected = source.clone()
    values_ref, indices_ref = ref.topk_select(x, n // 100, expected, False)
    for streaming in (True, False):
        for offset in (0, 1):  # a residual 32-byte aligned, and one that is not (stored through the cache)
            residual = torch.full((n + 8,), float("nan"))[offset : offset + n]
            _NATIVE._set_streaming(streaming)
            try:
                values, indices = ops.topk_select(x, n // 100, residual, False, residual_source=source)
            finally:
                _NATIVE._set_streaming(True)
            _assert_same(indices, indices_ref)
            _assert_same(values, values_ref)
            _assert_same(residual, expected)
