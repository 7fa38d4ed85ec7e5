"""PowerSGD's matrix ops (``powersgd_project``, ``powersgd_back_project``, ``powersgd_expand``) against their
plain-PyTorch twins.

Unlike the other ops, these sum in their own fixed order (MKL's GEMM blocks its sums its own way), so they
are held to fp32 rounding of the sums, not to the bits: a product of ``K`` terms to ``K * eps`` of the sum of
the terms' magnitudes. The parts that are not sums (``x = gradient + residual``) are held to the bits. Both
builds of the native loops (AVX2 and baseline) and both ways of storing rows (non-temporal or through the
cache) must give identical bits.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import test_ops_into  # noqa: E402

from fastcomm import ops  # noqa: E402
from fastcomm import reference as ref  # noqa: E402

EPS = 2.0**-23

# (rows, cols, rank): odd sizes, a rank above the kernels' block of 4, one row, one column, and one matrix
# large enough (16 MB) for the non-temporal stores
SHAPES = [(1, 1, 1), (1, 13, 1), (37, 1001, 3), (5, 7, 9), (64, 8, 4), (300, 1030, 6), (2048, 2050, 4)]


# the native kernels' module and the ``isa`` fixture (each test once per build of the loops: AVX2, baseline)
_NATIVE = test_ops_into._NATIVE
isa = test_ops_into.isa


def _randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g) * torch.exp(torch.randn(*shape, generator=g)) * scale


def _bound(terms: torch.Tensor, count: int) -> torch.Tensor:
    """Rounding bound of a sum of ``count`` fp32 products whose magnitudes sum to ``terms``."""
    return 2 * (count + 2) * EPS * terms + torch.finfo(torch.float32).tiny


def _in_flat(n: int, m: int, seed: int, offset: int) -> torch.Tensor:
    """An ``n x m`` view at ``offset`` in a flat buffer, as a parameter is in a bucket (unaligned rows)."""
    flat = _randn(offset + n * m + 3, seed=seed)
    return flat[offset : offset + n * m].view(n, m)


@pytest.mark.parametrize("n,m,r", SHAPES)
@pytest.mark.parametrize("form", ["gradient+residual", "gradient", "x"])
def test_project_matches_reference(isa, n, m, r, form):
    gradient = _in_flat(n, m, seed=n + m + r, offset=1)
    residual = _randn(n, m, seed=r, scale=0.1) if form == "gradient+residual" else None
    q_t = _randn(r, m, seed=7 * r)
    x, x_ref = torch.full((n, m), float("nan")), torch.full((n, m), float("nan"))
    if form == "x":
        x, x_ref = gradient.clone(), gradient.clone()
    args = (gradient, residual) if form != "x" else (None, None)
    p, p_ref = torch.full((n, r), float("nan")), torch.full((n, r), float("nan"))
    assert ops.powersgd_project(p, x, q_t, *args) is p
    ref.powersgd_project(p_ref, x_ref, q_t, *args)
    assert torch.equal(x, x_ref)  # the sum is one IEEE add per element everywhere
    bound = _bound(x_ref.abs() @ q_t.abs().T, m)
    assert ((p - p_ref).abs() <= bound).all(), (p - p_ref).abs().max()


@pytest.mark.parametrize("n,m,r", SHAPES)
def test_back_project_matches_reference(isa, n, m, r):
    x = _in_flat(n, m, seed=3 * n + m, offset=3)
    p = _randn(n, r, seed=r + 11)
    q_t, q_ref = torch.full((r, m), float("nan")), torch.full((r, m), float("nan"))
    assert ops.powersgd_back_project(q_t, p, x) is q_t
    ref.powersgd_back_project(q_ref, p, x)
    bound = _bound(p.abs().T @ x.abs(), n)
    assert ((q_t - q_ref).abs() <= bound).all(), (q_t - q_ref).abs().max()


@pytest.mark.parametrize("n,m,r", SHAPES)
@pytest.mark.parametrize("with_residual", [True, False])
def test_expand_matches_reference(isa, n, m, r, with_residual):
    p, q_t = _randn(n, r, seed=n + 5), _randn(r, m, seed=m + 6)
    x = _in_flat(n, m, seed=n * m, offset=5)
    residual = x.clone() if with_residual else None
    residual_ref = x.clone() if with_residual else None
    mean, mean_ref = torch.full((n, m), float("nan")), torch.full((n, m), float("nan"))
    assert ops.powersgd_expand(mean, p, q_t, residual) is mean
    ref.powersgd_expand(mean_ref, p, q_t, residual_ref)
    bound = _bound(p.abs() @ q_t.abs(), r)
    assert ((mean - mean_ref).abs() <= bound).all(), (mean - mean_ref).abs().max()
    if with_residual:
        # x - a, each a within the bound: one more rounding of the difference
        assert ((residual - residual_ref).abs() <= bound + 2 * EPS * residual_ref.abs()).all()
        # the kernel's own residual is x minus its own mean, exactly (one IEEE subtraction)
        assert torch.equal(residual, x - mean)


@pytest.mark.skipif(_NATIVE is None, reason="native kernels not built")
def test_loop_builds_and_store_paths_give_the_same_bits():
    n, m, r = 2048, 2051, 4  # 16 MB: streamed unless told otherwise; odd m makes some rows unaligned
    gradient, residual = _randn(n, m, seed=1), _randn(n, m, seed=2, scale=0.1)
    q_t, p_in = _randn(r, m, seed=3), _randn(n, r, seed=4)
    results = []
    for avx2 in [True, False] if _NATIVE.cpu_isa() == "avx2" else [False]:
        for streaming in (True, False):
            _NATIVE._set_avx2(avx2)
            _NATIVE._set_streaming(streaming)
            try:
                x, p = torch.empty(n, m), torch.empty(n, r)
                ops.powersgd_project(p, x, q_t, gradient, residual)
                q_out = torch.empty(r, m)
                ops.powersgd_back_project(q_out, p_in, x)
                mean, res = torch.empty(n, m), x.clone()
                ops.powersgd_expand(mean, p_in, q_t, res)
            finally:
                _NATIVE._set_avx2(True)
                _NATIVE._set_streaming(True)
            results.append((x, p, q_out, mean, res))
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            assert torch.equal(a, b)


@pytest.mark.skipif(_NATIVE is None, reason="native kernels not built")
def test_results_do_not_depend_on_the_thread_count():
    n, m, r = 301, 2500, 5
    x, p, q_t = _randn(n, m, seed=8), _randn(n, r, seed=9), _randn(r, m, seed=10)
    outs = []
    threads = torch.get_num_threads()
    for count in (1, 2):
        torch.set_num_threads(count)
        try:
            q_out, mean, res = torch.empty(r, m), torch.empty(n, m), x.clone()
            p_out = torch.empty(n, r)
            ops.powersgd_project(p_out, x.clone(), q_t)
            ops.powersgd_back_project(q_out, p, x)
            ops.powersgd_expand(mean, p, q_t, res)
        finally:
            torch.set_num_threads(threads)
        outs.append((p_out, q_out, mean, res))
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)


def test_zero_rank_and_empty_matrices():
    gradient, residual = _randn(3, 5, seed=1), _randn(3, 5, seed=2)
    x = torch.empty(3, 5)
    ops.powersgd_project(torch.empty(3, 0), x, torch.empty(0, 5), gradient, residual)
    assert torch.equal(x, gradient + residual)  # x is formed even when there is nothing to project
    q_t = torch.empty(0, 5)
    ops.powersgd_back_project(q_t, torch.empty(3, 0), x)
    mean = torch.full((3, 5), 9.0)
    ops.powersgd_expand(mean, torch.empty(3, 0), torch.empty(0, 5))
    assert torch.equal(mean, torch.zeros(3, 5))
    ops.powersgd_expand(torch.empty(0, 4), torch.empty(0, 2), torch.ones(2, 4))


@pytest.mark.parametrize(
    "call,exc,words",
    [
        (
            lambda: ops.powersgd_project(
                torch.empty(3, 2), torch.empty(3, 5, dtype=torch.float16), torch.ones(2, 5)
            ),
            TypeError,
            ("x", "float32"),
        ),
        (
            lambda: ops.powersgd_project(torch.empty(3, 2), torch.empty(3, 5), torch.ones(2, 4)),
            ValueError,
            ("q_t", "2 x 5"),
        ),
        (
            lambda: ops.powersgd_project(torch.empty(3, 1), torch.empty(3, 5), torch.ones(2, 5)),
            ValueError,
            ("p", "3 x 2"),
        ),
        (
            lambda: ops.powersgd_project(
                torch.empty(3, 2), torch.empty(3, 5), torch.ones(2, 5), None, torch.ones(3, 5)
            ),
            ValueError,
            ("residual needs gradient",),
        ),
        (
            lambda: ops.powersgd_project(
                torch.empty(3, 2), torch.empty(3, 5), torch.ones(2, 5), torch.ones(5, 3).T
            ),
            ValueError,
            ("gradient", "contiguous rows"),
        ),
        (
            lambda: ops.powersgd_project(torch.empty(3, 2), torch.empty(15), torch.ones(2, 5)),
            ValueError,
            ("x", "2-D"),
        ),
        (
            lambda: ops.powersgd_back_project(torch.empty(2, 5), torch.empty(3, 2), torch.empty(4, 5)),
            ValueError,
            ("p", "4 x 2"),
        ),
        (
            lambda: ops.powersgd_expand(
                torch.empty(3, 5), torch.empty(3, 2), torch.ones(2, 5), torch.empty(3, 4)
            ),
            ValueError,
            ("residual", "3 x 5"),
        ),
        (
            lambda: (lambda t: ops.powersgd_expand(t, torch.empty(3, 2), torch.ones(2, 5), t))(
                torch.empty(3, 5)
            ),
            ValueError,
            ("different tensors",),
        ),
    ],
)
def test_bad_input_names_the_argument(call, exc, words):
    with pytest.raises(exc) as info:
        call()
    for word in words:
        assert word in str(info.value)


@pytest.mark.skipif(_NATIVE is None, reason="native kernels not built")
def test_native_kernels_check_their_arguments():
    # straight to the dispatcher, past the Python checks: the C++ side refuses too, naming the argument
    with pytest.raises(ValueError, match="q_t must be 2 x 5"):
        torch.ops.fastcomm.powersgd_expand(torch.empty(3, 5), torch.empty(3, 2), torch.ones(2, 4), None)
    with pytest.raises(TypeError, match="x must be float32"):
        torch.ops.fastcomm.powersgd_back_project(
            torch.empty(2, 5), torch.empty(3, 2), torch.empty(3, 5, dtype=torch.bfloat16)
        )
