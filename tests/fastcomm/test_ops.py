"""Every fastcomm op, on every device here, against its plain-PyTorch twin in fastcomm.reference.

The reference is the specification and the kernels reproduce it bit for bit (see reference.py's docstring),
so most comparisons are exact. The one exception is sign_compress's scale: a mean of |acc| summed in fp64
in a different order by each backend, which can differ in the last fp32 bit after rounding; it is held to one
ulp, and the residual (``acc - scale``) to one ulp of the scale.

Run under FASTCOMM_NO_NATIVE=1 as well (``make test`` does): the same checks then exercise the fallback.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from fastcomm import ops
from fastcomm import reference as ref

sys.path.insert(0, str(Path(__file__).parent))
from _op_inputs import DEVICES, DTYPES  # noqa: E402
from _op_inputs import randn as _randn

# 1_000_003 splits the native loops into many parallel chunks (65537: two). It is marked `large`: the
# FASTCOMM_NO_NATIVE=1 pass of `make test` leaves it out, since there the op under test is the reference.
SIZES = [1, 7, 1000, 65537, pytest.param(1_000_003, marks=pytest.mark.large)]

# Relative precision (machine epsilon) per dtype: the size of one rounding.
EPS = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}


def _seed(*parts: object) -> int:
    return abs(hash(parts)) % (2**31)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("exact", [True, False])
def test_topk_select_matches_reference(device, dtype, n, exact):
    x = _randn(n, dtype, device, _seed("topk", n))
    for k in sorted({1, max(1, n // 100), n // 3, n}):
        residual = (_randn(n, dtype, device, _seed("res", n, k)) * 0.5).to(dtype)
        residual_ref = residual.cpu().clone()
        values, indices = ops.topk_select(x, k, residual=residual, exact=exact)
        values_ref, indices_ref = ref.topk_select(x.cpu(), k, residual=residual_ref, exact=exact)
        assert indices.dtype == torch.int32 and values.dtype == dtype
        torch.testing.assert_close(indices.cpu(), indices_ref, rtol=0, atol=0)
        torch.testing.assert_close(values.cpu(), values_ref, rtol=0, atol=0)
        torch.testing.assert_close(residual.cpu(), residual_ref, rtol=0, atol=0)
        if exact:
            assert indices.numel() == k


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_topk_select_error_feedback_is_exact(device, dtype):
    n, k = 20011, 97
    x = _randn(n, dtype, device, 1)
    residual = _randn(n, dtype, device, 2)
    expected = x + residual  # rounded once in dtype, as the op does
    values, indices = ops.topk_select(x, k, residual=residual)
    sent = torch.zeros_like(x).index_put_((indices.long(),), values)
    assert torch.equal(sent + residual, expected)
    assert torch.count_nonzero(residual[indices.long()]) == 0


def test_topk_select_exact_really_takes_the_largest():
    x = _randn(50000, torch.float32, "cpu", 3)
    values, indices = ops.topk_select(x, 500)
    expected = torch.topk(x.abs(), 500).indices.sort().values.to(torch.int32)
    assert torch.equal(indices, expected)
    assert torch.equal(values, x[indices.long()])


def test_topk_select_ties_take_lowest_index():
    x = torch.tensor([1.0, -3.0, 3.0, 2.0, -3.0, 3.0])
    values, indices = ops.topk_select(x, 2)
    assert indices.tolist() == [1, 2] and values.tolist() == [-3.0, 3.0]


def test_topk_select_approximate_returns_about_k():
    x = _randn(1_000_003, torch.float32, "cpu", 4)
    for k in (1000, 10000, 50000):
        values, indices = ops.topk_select(x, k, exact=False)
        assert abs(indices.numel() - k) < 0.2 * k, (k, indices.numel())
        smallest_sent = values.abs().min()
        assert (x.abs() > smallest_sent).sum() < indices.numel()  # nothing left out above the threshold


def test_topk_select_nonfinite_always_sent():
    x = _randn(10000, torch.float32, "cpu", 5)
    x[17] = float("nan")
    x[4242] = float("-inf")
    _, indices = ops.topk_select(x, 3)
    assert {17, 4242} <= set(indices.tolist())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("bits", [8, 4, 2])
def test_quantize_blockwise_matches_reference(device, dtype, n, bits):
    x = _randn(n, dtype, device, _seed("quant", n, bits))
    for block, stochastic in ((256, False), (256, True), (7, True), (1000, False)):
        codes, scales = ops.quantize_blockwise(x, bits=bits, block=block, stochastic=stochastic, seed=99)
        codes_ref, scales_ref = ref.quantize_blockwise(x.cpu(), bits, block, stochastic, 99)
        assert codes.dtype == torch.uint8 and codes.numel() == -(-n * bits // 8)
        torch.testing.assert_close(scales.cpu(), scales_ref, rtol=0, atol=0)
        torch.testing.assert_close(codes.cpu(), codes_ref, rtol=0, atol=0)
        out = ops.dequantize_blockwise(codes, scales, n, bits=bits, block=block, dtype=dtype)
        out_ref = ref.dequantize_blockwise(codes_ref, scales_ref, n, bits, block, dtype)
        torch.testing.assert_close(out.cpu(), out_ref, rtol=0, atol=0)
        # Analytic bound: half a step (nearest) or one step (stochastic); x * inv and the scale are each
        # rounded in fp32, which moves |v| <= qmax by up to ~3 qmax eps steps; plus the output dtype's
        # rounding.
        step = scales_ref[torch.arange(n) // block]
        qmax = 2 ** (bits - 1) - 1
        fp32_slack = 4 * qmax * EPS[torch.float32]
        x32, out32 = x.cpu().float(), out.cpu().float()
        bound = (
            step * ((1.0 if stochastic else 0.5) + fp32_slack)
            + torch.maximum(x32.abs(), out32.abs()) * EPS[dtype]
        )
        assert ((out32 - x32).abs() <= bound).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", [8, 4, 2])
def test_stochastic_rounding_is_unbiased(device, bits):
    n, trials, block = 512, 400, 64
    x = _randn(n, torch.float32, device, 6)
    total = torch.zeros(n, dtype=torch.float64)
    for seed in range(trials):
        codes, scales = ops.quantize_blockwise(x, bits=bits, block=block, stochastic=True, seed=seed)
        total += ops.dequantize_blockwise(codes, scales, n, bits=bits, block=block).cpu().double()
    mean = total / trials
    # Each draw is x + e with |e| < one step and Var(e) <= step^2 / 4: the mean of 400 draws lies within
    # 6 standard deviations (step / (2 sqrt(trials))) of x for every element, unless rounding is biased.
    step = scales.cpu().double()[torch.arange(n) // block]
    assert ((mean - x.cpu().double()).abs() <= 6 * step / (2 * trials**0.5) + 1e-7).all()
    # Nearest rounding, by contrast, is biased on the same data.
    codes, scales = ops.quantize_blockwise(x, bits=bits, block=block, stochastic=False)
    nearest = ops.dequantize_blockwise(codes, scales, n, bits=bits, block=block).cpu().double()
    assert (nearest - x.cpu().double()).abs().max() > 6 * step.max() / (2 * trials**0.5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [8, 4, 2])
def test_quantize_blockwise_error_feedback(device, dtype, bits):
    n = 20011
    x = _randn(n, dtype, device, _seed("qef", bits))
    for block, stochastic in ((256, True), (7, False)):
        residual = _randn(n, dtype, device, _seed("qres", bits, block)) * 0.1
        residual_ref = residual.cpu().clone()
        acc = (x + residual).cpu()
        codes, scales = ops.quantize_blockwise(x, bits, block, stochastic, 5, residual=residual)
        codes_ref, scales_ref = ref.quantize_blockwise(
            x.cpu(), bits, block, stochastic, 5, residual=residual_ref
        )
        torch.testing.assert_close(codes.cpu(), codes_ref, rtol=0, atol=0)
        torch.testing.assert_close(scales.cpu(), scales_ref, rtol=0, atol=0)
        torch.testing.assert_close(residual.cpu(), residual_ref, rtol=0, atol=0)
        # The codes are those of acc = x + residual, and residual = acc - sent up to one rounding in dtype.
        assert torch.equal(codes_ref, ref.quantize_blockwise(acc, bits, block, stochastic, 5)[0])
        sent = ref.dequantize_blockwise(codes_ref, scales_ref, n, bits, block).double()
        error = (sent + residual_ref.double() - acc.double()).abs()
        # One rounding to dtype: relative EPS for normal results, absolute below (subnormal spacing).
        assert (
            error
            <= EPS[dtype] * (acc.double() - sent).abs() + torch.finfo(dtype).smallest_normal * EPS[dtype]
        ).all()


def test_quantize_subnormal_block_encodes_zero():
    x = _randn(512, torch.float32, "cpu", 17)
    x[:256] *= 1e-44  # absmax subnormal: qmax / absmax overflows fp32
    codes, scales = ops.quantize_blockwise(x, bits=8)
    out = ops.dequantize_blockwise(codes, scales, 512)
    assert (codes[:256] == 128).all() and (out[:256] == 0).all()
    assert (out[256:] != 0).any()


def test_quantize_seed_changes_codes_and_repeats():
    x = _randn(4099, torch.float32, "cpu", 7)
    a = ops.quantize_blockwise(x, bits=4, stochastic=True, seed=1)[0]
    b = ops.quantize_blockwise(x, bits=4, stochastic=True, seed=1)[0]
    c = ops.quantize_blockwise(x, bits=4, stochastic=True, seed=2)[0]
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_quantize_nonfinite_block_dequantizes_to_nan():
    x = _randn(1000, torch.float32, "cpu", 8)
    x[300] = float("inf")
    codes, scales = ops.quantize_blockwise(x, bits=8, block=256)
    out = ops.dequantize_blockwise(codes, scales, 1000)
    assert torch.isnan(out[256:512]).all()
    assert torch.isfinite(out[:256]).all() and torch.isfinite(out[512:]).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_sign_compress_matches_reference(device, dtype, n):
    x = _randn(n, dtype, device, _seed("sign", n))
    for chunk in (2048, 5, 8):
        residual = _randn(n, dtype, device, _seed("sres", n, chunk))
        residual_ref = residual.cpu().clone()
        packed, scales = ops.sign_compress(x, residual=residual, chunk=chunk)
        packed_ref, scales_ref = ref.sign_compress(x.cpu(), residual=residual_ref, chunk=chunk)
        torch.testing.assert_close(packed.cpu(), packed_ref, rtol=0, atol=0)
        # fp64 sums in another order: equal after rounding to fp32 up to one ulp.
        torch.testing.assert_close(scales.cpu(), scales_ref, rtol=EPS[torch.float32], atol=0)
        step = scales_ref[torch.arange(n) // chunk]
        slack = step * EPS[torch.float32] + residual_ref.float().abs() * EPS[dtype]
        assert ((residual.cpu().float() - residual_ref.float()).abs() <= slack).all()
        out = ops.sign_decompress(packed, scales, n, chunk=chunk, dtype=dtype)
        out_ref = ref.sign_decompress(packed_ref, scales_ref, n, chunk, dtype)
        torch.testing.assert_close(out.cpu(), out_ref, rtol=EPS[dtype], atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_results_do_not_depend_on_the_thread_count(dtype):
    # `make test` runs every process on one intra-op thread (FASTLIB_TEST_THREADS=1: workers side by side on
    # 2 cores only spin in each other's way with more), so the parallel chunks of the native loops are run
    # here on 1, 2 and 3 threads: the same bits each time.
    n = 300_001
    x = _randn(n, dtype, "cpu", _seed("threads", n))
    start = _randn(n, dtype, "cpu", _seed("threads-residual", n))
    threads = torch.get_num_threads()
    results = []
    for count in (1, 2, 3):
        torch.set_num_threads(count)
        try:
            out = []
            for bits in (8, 4):
                residual = start.clone()
                codes, scales = ops.quantize_blockwise(x, bits=bits, block=256, stochastic=True, seed=5,
                                                       residual=residual)  # fmt: skip
                out += [codes, scales, residual]
                out.append(ops.dequantize_blockwise(codes, scales, n, bits=bits, dtype=dtype))
            residual = start.clone()
            packed, scales = ops.sign_compress(x, residual=residual, chunk=2048)
            out += [packed, scales, residual, ops.sign_decompress(packed, scales, n, chunk=2048, dtype=dtype)]
            for exact in (True, False):
                residual = start.clone()
                out += [*ops.topk_select(x, n // 100, residual, exact), residual]
        finally:
            torch.set_num_threads(threads)
        results.append(out)
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sign_compress_error_feedback_invariant(dtype):
    n = 10007
    x = _randn(n, dtype, "cpu", 9)
    residual = _randn(n, dtype, "cpu", 10)
    acc = (x + residual).double()
    packed, scales = ops.sign_compress(x, residual=residual, chunk=512)
    sent = ops.sign_decompress(packed, scales, n, chunk=512).double()
    # residual = fl(acc - sent): exact in real arithmetic, so the invariant holds up to that one rounding.
    error = (sent + residual.double() - acc).abs()
    assert (error <= EPS[dtype] * (acc - sent).abs() + torch.finfo(dtype).smallest_normal * EPS[dtype]).all()
    assert torch.equal(sent > 0, acc >= 0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_sparse_accumulate_matches_reference(device, dtype):
    out = _randn(1000, dtype, device, 11)
    out_ref = out.cpu().clone()
    g = torch.Generator().manual_seed(12)
    indices = torch.randint(0, 1000, (3001,), generator=g, dtype=torch.int32)
    values = torch.randn(3001, generator=g)
    result = ops.sparse_accumulate(out, indices.to(device), values.to(device))
    assert result is out
    start = out_ref.clone()
    ref.sparse_accumulate(out_ref, indices, values)
    if device == "cpu":  # one order of additions, as the reference's
        torch.testing.assert_close(out.cpu(), out_ref, rtol=EPS[dtype], atol=EPS[dtype])
        return
    # CUDA adds the entries of one index in any order (atomics): each of its k additions rounds once in
    # dtype, so two orders differ by at most 2 (k + 1) eps times the magnitudes summed there
    counts = torch.bincount(indices.long(), minlength=1000).double()
    mass = start.double().abs().index_add_(0, indices.long(), values.double().abs())
    bound = 2 * (counts + 1) * EPS[dtype] * mass
    assert ((out.cpu().double() - out_ref.double()).abs() <= bound).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_sparse_mean_matches_reference(device, dtype, index_dtype, world_size):
    # a kept buffer over three steps: each clears what the last wrote; payloads of world_size ranks with
    # entries shared between ranks (duplicates are divided once) and an odd size
    n = 100_003
    out = _randn(n, dtype, device, 21)
    out_ref = out.cpu().clone()
    g = torch.Generator().manual_seed(22)
    previous = None
    for _ in range(3):
        rows = [torch.randperm(n, generator=g)[:997].sort().values for _ in range(world_size)]
        indices = torch.cat(rows).to(index_dtype)
        values = torch.randn(indices.numel(), generator=g)
        clear = None if previous is None else previous
        ops.sparse_mean(out, indices.to(device), values.to(device), world_size,
                        clear=None if clear is None else clear.to(device))  # fmt: skip
        ref.sparse_mean(out_ref, indices, values, world_size, clear=clear)
        previous = indices
        if device == "cpu":  # one order of additions, as the reference's
            assert torch.equal(out.cpu(), out_ref)
        else:
            torch.testing.assert_close(out.cpu(), out_ref, rtol=4 * EPS[dtype], atol=4 * EPS[dtype])
    touched = torch.zeros(n, dtype=torch.bool)
    touched[previous.long()] = True
    assert out_ref[touched].ne(0).any() and out_ref[~touched].ne(0).any()  # cleared, written and kept entries


def test_ops_accept_noncontiguous_inputs():
    base = _randn(20000, torch.float32, "cpu", 13)
    x = base[::2]
    residual_base = _randn(20000, torch.float32, "cpu", 14)
    residual = residual_base[1::2]
    residual_ref = residual.clone()
    v, i = ops.topk_select(x, 100, residual=residual)
    v_ref, i_ref = ref.topk_select(x.contiguous(), 100, residual=residual_ref)
    assert torch.equal(i, i_ref) and torch.equal(v, v_ref) and torch.equal(residual, residual_ref)
    assert torch.equal(residual_base[1::2], residual_ref)  # written back into the caller's strided buffer
    codes, scales = ops.quantize_blockwise(x.view(100, 100).t())
    codes_ref, scales_ref = ref.quantize_blockwise(x.view(100, 100).t().contiguous())
    assert torch.equal(codes, codes_ref) and torch.equal(scales, scales_ref)
    residual = residual_base[::2]
    residual_ref = residual.clone()
    packed, _ = ops.sign_compress(x, residual=residual, chunk=64)
    packed_ref, _ = ref.sign_compress(x, residual=residual_ref, chunk=64)
    assert torch.equal(packed, packed_ref)


def test_decompress_accepts_any_payload_shape():
    # Payloads arrive as rows of a gathered buffer: only numel counts, as in the native kernels.
    x = _randn(1000, torch.float32, "cpu", 18)
    codes, scales = ops.quantize_blockwise(x, bits=4, block=100)
    packed, sign_scales = ops.sign_compress(x, chunk=100)
    for module in (ops, ref):
        assert torch.equal(
            module.dequantize_blockwise(codes.view(2, -1), scales.view(2, 5), 1000, 4, 100),
            ref.dequantize_blockwise(codes, scales, 1000, 4, 100),
        )
        assert torch.equal(
            module.sign_decompress(packed.view(5, -1), sign_scales.view(2, 5), 1000, 100),
            ref.sign_decompress(packed, sign_scales, 1000, 100),
        )
