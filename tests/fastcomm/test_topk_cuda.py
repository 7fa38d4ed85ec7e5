"""The CUDA C++ ``topk_select`` kernel (csrc/comm/topk_cuda.cu) against ``fastcomm.reference`` on CPU.

Selection involves no arithmetic beyond ``x + residual`` in x's dtype, so values, indices and the updated
residual must all equal the reference bit for bit, in exact and in approximate mode.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _topk_cases import assert_same, check_topk, topk_inputs  # noqa: E402

import fastcomm.ops  # noqa: F401  (declares the ops and loads fastcomm._C)
from fastcomm import reference

pytestmark = pytest.mark.skipif(
    not (
        torch.cuda.is_available()
        and torch._C._dispatch_has_kernel_for_dispatch_key("fastcomm::topk_select", "CUDA")
    ),
    reason="needs a CUDA device and fastcomm._C built against a CUDA torch (the CUDA topk_select kernel)",
)

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _inputs(n: int, kind: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return topk_inputs(n, n, kind, dtype)


def _check(x: torch.Tensor, residual: torch.Tensor | None, k: int, exact: bool) -> None:
    check_topk(torch.ops.fastcomm.topk_select, "cuda", x, residual, k, exact)


@pytest.mark.parametrize("kind", ["randn", "ties", "sparse", "nonfinite"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 7, 1000, 4099, 20_011, 1_000_003])
def test_exact_matches_reference(n: int, dtype: torch.dtype, kind: str) -> None:
    x, residual = _inputs(n, kind, dtype)
    for k in sorted({1, min(n, 3), max(1, n // 100), n // 7, n}):
        if k:
            _check(x, residual, k, exact=True)
    _check(x, None, max(1, n // 10), exact=True)


@pytest.mark.parametrize("kind", ["randn", "ties", "sparse", "nonfinite"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_approximate_matches_reference(dtype: torch.dtype, kind: str) -> None:
    n = 1_000_003
    x, residual = _inputs(n, kind, dtype)
    for k in (20_000, 100_000, 400_000):
        assert reference.approx_sample_size(n, k) * 2 <= n  # really the sampled threshold, not the fallback
        _check(x, residual, k, exact=False)
    _check(x, None, 50_000, exact=False)


def test_k_zero_still_accumulates_residual() -> None:
    x, residual = _inputs(1000, "randn", torch.float32)
    _check(x, residual, 0, exact=True)


def test_non_contiguous_residual() -> None:
    x = torch.randn(300, 70).t()
    residual = (torch.randn(300, 70) * 0.1).t()
    _check(x, residual, 500, exact=True)
    _check(x, residual, 500, exact=False)


def test_opcheck() -> None:
    x = torch.randn(4099, device="cuda")
    torch.library.opcheck(torch.ops.fastcomm.topk_select, (x, 50, torch.zeros_like(x), True))


@pytest.mark.parametrize("exact", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_residual_source(dtype: torch.dtype, exact: bool) -> None:
    """residual_source is read, residual only written: the result of residual.copy_(source) then in place."""
    n = 1_000_003
    x, source = _inputs(n, "randn", dtype)
    stale = torch.randn(n, generator=torch.Generator().manual_seed(1)).to(dtype)
    expected = source.clone()
    ref_values, ref_indices = reference.topk_select(x, 20_000, expected, exact)
    strided = torch.empty(2 * n, dtype=dtype, device="cuda")[::2].copy_(stale)  # written back through copy_
    for residual in (stale.cuda(), strided):
        source_cuda = source.cuda()
        values, indices = torch.ops.fastcomm.topk_select(x.cuda(), 20_000, residual, exact, source_cuda)
        assert torch.equal(indices.cpu(), ref_indices)
        assert_same(values, ref_values)
        assert_same(residual, expected)
        assert_same(source_cuda, source)
