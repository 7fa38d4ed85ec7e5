"""The compressors of ``fastcomm.compress`` outside a hook, and a new compressor added by one registry call.

Each compressor is checked against the reference ops on random inputs: the payload decodes to what the
reference kernels give, error feedback keeps ``decoded + residual == input`` (up to one rounding), and the
payload's size is what ``wire_bytes`` says.
"""

import sys
import zlib
from pathlib import Path

import pytest
import torch

import fastcomm
from fastcomm import reference
from fastcomm.compress import CastCompressor, Compressor, QuantCompressor, SignCompressor, TopKCompressor

sys.path.insert(0, str(Path(__file__).parent))
import _compressor_workers  # noqa: E402
import _hooks_workers as workers  # noqa: E402

CASES = {
    "sign": lambda: SignCompressor(chunk=64),
    "quantize8": lambda: QuantCompressor(bits=8, block=64, stochastic=False),
    "quantize4": lambda: QuantCompressor(bits=4, block=32, stochastic=False),
    "quantize2_stochastic": lambda: QuantCompressor(bits=2, block=64, stochastic=True),
    "topk": lambda: TopKCompressor(k=37, exact=True),
}


def _input(case: str, numel: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(zlib.crc32(repr((case, numel)).encode()))
    return torch.randn(numel, generator=gen) * 3


@pytest.mark.parametrize("case", sorted(CASES))
def test_compressor_error_feedback_keeps_the_input(case):
    compressor = CASES[case]()
    assert isinstance(compressor, Compressor)
    x = _input(case, 1024)
    residual_in = _input(case + "residual", 1024) * 0.1
    residual_out = torch.empty_like(x)
    payload = torch.empty(compressor.wire_bytes(x.numel(), x.dtype), dtype=torch.uint8)
    compressor.compress_into(payload, x, residual_out, residual_in, seed=5)
    decoded = torch.empty_like(x)
    compressor.decompress_into(decoded, payload, x.numel())
    torch.testing.assert_close(decoded + residual_out, x + residual_in, rtol=0, atol=4e-6)
    assert compressor.payload_finite(payload.view(1, -1), x.numel(), x.dtype)
    again = torch.empty_like(x).fill_(1.0)
    compressor.decompress_into(again, payload, x.numel(), accumulate=True, divisor=2)
    torch.testing.assert_close(again, 1.0 + decoded / 2, rtol=0, atol=1e-6)


@pytest.mark.parametrize("wire", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("residuals", ["none", "in-only", "out-only", "both", "same-tensor", "bf16-residual"])
def test_cast_compress_into_is_the_fp32_sum_rounded_and_its_remainder(wire, x_dtype, residuals):
    """The cast compressor against its reference twin (the sum in fp32, rounded to the wire dtype, the
    remainder kept), odd size, for every way its residuals can come, the same tensor in and out too."""
    compressor = CastCompressor(wire)
    numel = 1001
    x = _input("cast-x", numel).to(x_dtype)
    residual_dtype = torch.bfloat16 if residuals == "bf16-residual" else torch.float32
    given = (_input("cast-residual", numel) * 0.01).to(residual_dtype)
    residual_in = None if residuals in ("none", "out-only") else given.clone()
    if residuals in ("same-tensor", "bf16-residual"):
        residual_out = residual_in
    else:
        residual_out = None if residuals in ("none", "in-only") else torch.full((numel,), 7.0)
    acc = x.float() if residual_in is None else x.float() + residual_in.float()  # the reference twin
    expected_wire = acc.to(wire)
    expected_residual = (acc - expected_wire.float()).to(residual_dtype)
    payload = torch.empty(compressor.wire_bytes(numel, x.dtype), dtype=torch.uint8)
    compressor.compress_into(payload, x, residual_out, residual_in, seed=0)
    assert torch.equal(payload.view(wire), expected_wire)
    if residual_out is not None:
        assert torch.equal(residual_out, expected_residual)  # the 7.0 it held is gone too
        if not torch.equal(expected_wire.float(), acc):  # rounding left something: a lost remainder shows
            assert residual_out.abs().max() > 0


@pytest.mark.parametrize("case", ["sign", "quantize8", "quantize4"])
def test_blockwise_payload_matches_the_reference_ops(case):
    compressor = CASES[case]()
    x = _input(case, 512)
    payload = torch.empty(compressor.wire_bytes(x.numel(), x.dtype), dtype=torch.uint8)
    compressor.compress_into(payload, x, None, None, seed=0)
    decoded = torch.empty_like(x)
    compressor.decompress_into(decoded, payload, x.numel())
    if case == "sign":
        packed, scales = reference.sign_compress(x, None, 64)
        expected = reference.sign_decompress(packed, scales, x.numel(), 64)
    else:
        bits, block = compressor.bits, compressor.block
        codes, scales = reference.quantize_blockwise(x, bits, block, False, 0)
        expected = reference.dequantize_blockwise(codes, scales, x.numel(), bits, block)
    assert torch.equal(decoded, expected)
    nonfinite = x.clone()
    nonfinite[100] = float("nan")
    compressor.compress_into(payload, nonfinite, None, None, seed=0)
    assert not compressor.payload_finite(payload.view(1, -1), x.numel(), x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("seed", range(6))
def test_all_finite_agrees_with_isfinite(dtype, seed):
    from fastcomm.compress import all_finite

    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 5000, (1,), generator=g))
    big = torch.finfo(dtype).max / 4
    scale = big if seed % 3 == 0 else 1.0  # big: sums that overflow
    x = (torch.randn(n, generator=g).clamp(-3, 3) * scale).to(dtype)
    assert all_finite(x) is True
    for bad in (float("nan"), float("inf"), float("-inf")):
        y = x.clone()
        y[int(torch.randint(0, n, (1,), generator=g))] = bad
        assert all_finite(y) is bool(torch.isfinite(y).all()) is False
    assert all_finite(torch.full((3, 7), big, dtype=dtype)) is True  # every partial sum overflows


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("seed", range(4))
def test_scale_all_finite_is_mul_then_all_finite(dtype, seed):
    """The one-pass scale-and-check equals ``mul_`` by the fp32 factor then :func:`all_finite`, bit for bit,
    on odd sizes, with and without a non-finite element."""
    from fastcomm.compress import all_finite, scale_all_finite_

    g = torch.Generator().manual_seed(100 + seed)
    n = int(torch.randint(1, 70_000, (1,), generator=g))
    factor = (1.0 / 3.0, 0.5, 1.0 / 7.0, 3.0)[seed]
    x = (torch.randn(n, generator=g) * 10).to(dtype)
    for bad in (None, float("nan"), float("inf"), float("-inf")):
        y = x.clone()
        if bad is not None:
            y[int(torch.randint(0, n, (1,), generator=g))] = bad
        expected = y.clone().mul_(torch.tensor(factor, dtype=torch.float32))
        finite = all_finite(y)
        assert scale_all_finite_(y, factor) is finite is (bad is None)
        torch.testing.assert_close(y, expected, rtol=0, atol=0, equal_nan=True)
    assert scale_all_finite_(torch.empty(0, dtype=dtype), 0.5) is True
    with pytest.raises(TypeError, match="floating-point"):
        scale_all_finite_(torch.ones(3, dtype=torch.int32), 0.5)


def test_topk_payload_holds_the_k_largest_magnitudes():
    x = _input("topk-largest", 1000)
    compressor = TopKCompressor(k=10, exact=True)
    payload = torch.empty(compressor.wire_bytes(x.numel(), x.dtype), dtype=torch.uint8)
    compressor.compress_into(payload, x, None, None, seed=0)
    indices, values = compressor.unpack(payload, x.dtype)
    assert sorted(indices.tolist()) == sorted(x.abs().topk(10).indices.tolist())
    assert torch.equal(values, x[indices.long()])


def test_compressor_options_are_checked():
    with pytest.raises(ValueError, match="bits"):
        QuantCompressor(bits=8.0)
    with pytest.raises(ValueError, match="chunk"):
        SignCompressor(chunk=True)
    with pytest.raises(ValueError, match="k must"):
        TopKCompressor(k=0)
    with pytest.raises(TypeError, match="Compressor"):
        fastcomm.hooks.CompressorState(object())


def test_added_compressor_is_registered_by_name():
    fastcomm.hooks.add_compressor("half_in_process", _compressor_workers.HalfCompressor)
    assert fastcomm.hooks.HOOKS["half_in_process"].compressor is _compressor_workers.HalfCompressor
    with pytest.raises(ValueError, match="built-in"):
        fastcomm.hooks.add_compressor("topk", _compressor_workers.HalfCompressor)
    with pytest.raises(ValueError, match="already registered"):
        fastcomm.hooks.add_compressor("half_in_process", SignCompressor)


@pytest.mark.distributed
def test_new_compressor_trains_through_register(tmp_path):
    workers.spawn(tmp_path, 2, _compressor_workers.registered_compressor_worker)
