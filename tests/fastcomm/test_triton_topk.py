"""The Triton top-k kernels against ``fastcomm.reference.topk_select``, bit for bit.

Without CUDA the kernels run on CPU tensors under ``TRITON_INTERPRET=1`` (set by ``tests/conftest.py``), so
sizes stay small (about 1 s per 20k elements); with CUDA the same tests run compiled on ``cuda`` tensors.
Selection does no arithmetic beyond ``x + residual`` in ``x``'s dtype, so values, indices and the residual
must equal the reference exactly, ties and NaN included.
"""

from __future__ import annotations

import sys
import zlib
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _topk_cases import assert_same, check_topk, topk_inputs  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot run")

from fastcomm import reference  # noqa: E402
from fastcomm.triton import topk  # noqa: E402
from fastcomm.triton.topk import topk_select  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered:RuntimeWarning")  # interpreter's numpy on inf

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(case: tuple, n: int, kind: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return topk_inputs(zlib.crc32(repr(case).encode()), n, kind, dtype)


def _check(x: torch.Tensor, residual: torch.Tensor | None, k: int, exact: bool) -> None:
    check_topk(topk_select, DEVICE, x, residual, k, exact)


CASES = [
    (1, torch.float32, "randn", 1),
    (7, torch.float16, "ties", 3),
    (1000, torch.bfloat16, "nonfinite", 10),
    (4099, torch.float16, "sparse", 4099),
    (20_011, torch.bfloat16, "randn", 200),
    (20_011, torch.float32, "sparse", 5000),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{str(c[1])[6:]}-{c[2]}-k{c[3]}")
def test_exact_matches_reference(case: tuple) -> None:
    n, dtype, kind, k = case
    x, residual = _inputs(case, n, kind, dtype)
    _check(x, residual, k, exact=True)


class _LaunchCounter:
    """Stands in for a ``@triton.jit`` kernel and counts its launches."""

    def __init__(self, kernel) -> None:
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


@pytest.mark.parametrize(("kind", "gathers"), [("randn", 1), ("ties", 0)])
def test_exact_gathers_candidates_unless_a_quarter_share_the_first_digit(
    kind: str, gathers: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both ways of the exact mode: the later digits among the gathered candidates (randn), or over every
    key again (ties without a residual: the 2/7 of the keys equal to 3 share the k-th key's first digit)."""
    counter = _LaunchCounter(topk._gather_kernel)
    monkeypatch.setattr(topk, "_gather_kernel", counter)
    x, residual = _inputs(("paths", kind), 4099, kind, torch.float32)
    _check(x, residual if kind == "randn" else None, 41, exact=True)
    assert counter.launches == gathers


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_without_residual(dtype: torch.dtype) -> None:
    x, _ = _inputs(("plain", dtype), 3000, "ties", dtype)
    _check(x, None, 30, exact=True)


@pytest.mark.parametrize("kind", ["randn", "ties", "nonfinite"])
def test_approximate_matches_reference(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sampled threshold, on a sample small enough for the interpreter (both sides read the size from
    ``reference.approx_sample_size``); on CUDA at the reference's own sample size as well."""
    n = 20_011
    x, residual = _inputs(("approx", kind), n, kind, torch.float16)
    if DEVICE == "cuda":
        big = 1_000_003
        xb, rb = _inputs(("approx-big", kind), big, kind, torch.float16)
        assert reference.approx_sample_size(big, 10_000) * 2 <= big
        _check(xb, rb, 10_000, exact=False)
    monkeypatch.setattr(reference, "approx_sample_size", lambda n, k: min(n, 50 * n // k))
    assert reference.approx_sample_size(n, 200) * 2 <= n  # really the sampled threshold, not the fallback
    _check(x, residual, 200, exact=False)


def test_approximate_falls_back_to_exact_where_the_reference_does() -> None:
    x, residual = _inputs(("fallback",), 5000, "randn", torch.float32)
    assert reference.approx_sample_size(5000, 50) * 2 > 5000
    _check(x, residual, 50, exact=False)


@pytest.mark.parametrize("same", [False, True])
def test_residual_source(same: bool) -> None:
    """``residual_source``: the bits of ``residual.copy_(residual_source)`` and the in-place call."""
    x, source = _inputs(("source", same), 3001, "randn", torch.bfloat16)
    expected = source.clone()
    ref_values, ref_indices = reference.topk_select(x, 30, expected)
    source_dev = source.to(DEVICE)
    residual = source_dev if same else torch.randn(3001).to(torch.bfloat16).to(DEVICE)
    values, indices = topk_select(x.to(DEVICE), 30, residual, True, source_dev)
    assert torch.equal(indices.cpu(), ref_indices)
    assert_same(values, ref_values)
    assert_same(residual, expected)
    if not same:
        assert_same(source_dev, source)


def test_strided_input_and_residual() -> None:
    x = torch.randn(70, 40).t()
    residual = torch.randn(70, 40).t()
    assert not x.is_contiguous() and not residual.is_contiguous()
    expected = residual.clone()
    ref_values, ref_indices = reference.topk_select(x, 28, expected)
    device_residual = residual.to(DEVICE)
    values, indices = topk_select(x.to(DEVICE), 28, device_residual)
    assert torch.equal(indices.cpu(), ref_indices)
    assert_same(values, ref_values)
    assert_same(device_residual, expected)


@pytest.mark.parametrize("exact", [True, False])
def test_nothing_selected(exact: bool) -> None:
    """k = 0 sends nothing and keeps everything in the residual; an empty input gives empty outputs."""
    x, residual = _inputs(("k0", exact), 999, "randn", torch.float32)
    _check(x, residual, 0, exact)
    values, indices = topk_select(torch.empty(0, device=DEVICE), 0, torch.empty(0, device=DEVICE), exact)
    assert values.shape == (0,) and indices.shape == (0,)


def test_residual_source_without_residual_is_refused() -> None:
    with pytest.raises(ValueError, match="residual_source needs residual"):
        topk_select(torch.randn(10, device=DEVICE), 2, None, True, torch.randn(10, device=DEVICE))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: compiled Triton kernels need CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_one_percent_of_a_million_on_cuda(dtype: torch.dtype) -> None:
    """The benchmark's case (1%, exact) at a size the interpreter cannot afford."""
    x, residual = _inputs(("million", dtype), 1_000_003, "randn", dtype)
    _check(x, residual, 10_000, exact=True)
