"""What the top-k kernel tests share: their inputs (random, ties, sparse, non-finite) and the bit-for-bit
comparison of a kernel's values, indices and residual with ``fastcomm.reference.topk_select``."""

from __future__ import annotations

from collections.abc import Callable

import torch

from fastcomm import reference

__all__ = ["assert_same", "check_topk", "topk_inputs"]


def topk_inputs(seed: int, n: int, kind: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, residual)`` of ``n`` elements: ``kind`` is randn, ties (integers -3..3), sparse (90% zeros) or
    nonfinite (randn with NaN, inf and -inf); the residual is randn * 0.1."""
    generator = torch.Generator().manual_seed(seed)
    if kind == "ties":
        x = torch.randint(-3, 4, (n,), generator=generator).float()
    elif kind == "sparse":
        x = torch.randn(n, generator=generator)
        x[torch.rand(n, generator=generator) < 0.9] = 0.0
    else:
        x = torch.randn(n, generator=generator)
    if kind == "nonfinite" and n > 10:
        x[3], x[7], x[n // 2] = float("nan"), float("inf"), -float("inf")
    residual = torch.randn(n, generator=generator) * 0.1
    return x.to(dtype), residual.to(dtype)


def assert_same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal values (on CPU), NaN where the reference has NaN."""
    actual = actual.cpu()
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(actual), nan)
    assert torch.equal(actual[~nan], expected[~nan])


def check_topk(
    select: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    device: str,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    k: int,
    exact: bool,
) -> None:
    """``select(x, k, residual, exact)`` on ``device`` copies against the reference on the CPU originals."""
    expected_residual = residual.clone() if residual is not None else None
    ref_values, ref_indices = reference.topk_select(x, k, expected_residual, exact)
    device_residual = residual.to(device) if residual is not None else None
    values, indices = select(x.to(device), k, device_residual, exact)
    assert indices.dtype == torch.int32 and indices.device.type == device
    assert torch.equal(indices.cpu(), ref_indices)
    assert_same(values, ref_values)
    if residual is not None:
        assert_same(device_residual, expected_residual)
