"""Plain-PyTorch twins of PowerSGD's three passes over a matrix (project, back-project, expand).

Part of :mod:`fastcomm.reference`, which re-exports them (``fastcomm.reference.powersgd_project``): each is
registered as the default kernel of its op and is the one home of its signature and docstring. Unlike the
compression twins, the native kernels sum in their own fixed order, so they match these within fp32
rounding, not bit for bit.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["powersgd_back_project", "powersgd_expand", "powersgd_project"]


def powersgd_project(
    p: Tensor, x: Tensor, q_t: Tensor, gradient: Tensor | None = None, residual: Tensor | None = None
) -> Tensor:
    """PowerSGD's first pass over a matrix: ``x = gradient + residual`` (when ``gradient`` is given), then
    ``p = x q_t^T``, both in place.

    The native kernel forms each row of ``x`` and multiplies it by ``q_t`` while the row is in cache (one
    pass over the matrix where these two torch calls make two). It sums in its own fixed order, so it
    matches this twin within fp32 rounding, not bit for bit (MKL's GEMM blocks its sums its own way).

    Args:
        p: ``n x r`` fp32, written (rows contiguous).
        x: ``n x m`` fp32: written when ``gradient`` is given, else read.
        q_t: ``r x m`` fp32 (``Q`` transposed).
        gradient: ``n x m`` fp32, or ``None`` (``x`` already holds the matrix).
        residual: ``n x m`` fp32 added to ``gradient`` (error feedback), or ``None``; needs ``gradient``.

    Returns:
        ``p``.

    Example::

        >>> x, q_t, p = torch.empty(3, 5), torch.ones(2, 5), torch.empty(3, 2)
        >>> powersgd_project(p, x, q_t, gradient=torch.ones(3, 5), residual=torch.ones(3, 5))[0]
        tensor([10., 10.])
    """
    if gradient is not None:
        if residual is None:
            x.copy_(gradient)
        else:
            torch.add(gradient, residual, out=x)
    torch.mm(x, q_t.T, out=p)
    return p


def powersgd_back_project(q_t: Tensor, p: Tensor, x: Tensor) -> Tensor:
    """PowerSGD's second pass over a matrix: ``q_t = p^T x`` (``Q`` transposed), in place.

    The native kernel adds the rows of ``x`` into ``q_t`` in row order, a column tile at a time, so it
    matches this twin within fp32 rounding, not bit for bit.

    Args:
        q_t: ``r x m`` fp32, written (rows contiguous).
        p: ``n x r`` fp32.
        x: ``n x m`` fp32.

    Returns:
        ``q_t``.

    Example::

        >>> q_t = torch.empty(1, 3)
        >>> powersgd_back_project(q_t, torch.ones(2, 1), torch.ones(2, 3))
        tensor([[2., 2., 2.]])
    """
    torch.mm(p.T, x, out=q_t)
    return q_t


def powersgd_expand(mean: Tensor, p: Tensor, q_t: Tensor, residual: Tensor | None = None) -> Tensor:
    """PowerSGD's last pass over a matrix: ``mean = p q_t`` and ``residual -= p q_t``, in place.

    The native kernel computes each row of ``p q_t`` once and writes both (one pass where torch writes the
    product and reads it back). It sums the ``r`` terms of an element in order ``k = 0 .. r-1``, so it
    matches this twin within fp32 rounding, not bit for bit.

    Args:
        mean: ``n x m`` fp32, written (rows contiguous).
        p: ``n x r`` fp32 (orthonormal columns, in PowerSGD).
        q_t: ``r x m`` fp32 (the mean ``Q`` transposed).
        residual: ``n x m`` fp32 (``x`` on entry, ``x - p q_t`` on return), or ``None``.

    Returns:
        ``mean``.

    Example::

        >>> mean, residual = torch.empty(2, 3), torch.full((2, 3), 5.0)
        >>> powersgd_expand(mean, torch.ones(2, 1), torch.ones(1, 3), residual=residual)[0]
        tensor([1., 1., 1.])
        >>> residual[0]
        tensor([4., 4., 4.])
    """
    torch.mm(p, q_t, out=mean)
    if residual is not None:
        residual.sub_(mean)
    return mean
