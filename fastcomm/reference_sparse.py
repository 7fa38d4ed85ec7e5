"""Plain-PyTorch twins of the ops that sum the sparse payloads (top-k's) gathered from every rank.

Part of :mod:`fastcomm.reference`, which re-exports them (``fastcomm.reference.sparse_mean``): each is
registered as the default kernel of its op and is the one home of its signature and docstring. The CPU
kernels add in the same (payload) order and give the same bits.
"""

from __future__ import annotations

from torch import Tensor

__all__ = ["sparse_accumulate", "sparse_mean"]


def sparse_accumulate(out: Tensor, indices: Tensor, values: Tensor) -> Tensor:
    """Scatter-add ``values`` into ``out.view(-1)`` at ``indices`` (duplicates add up, in order), in place.

    ``out.view(-1)[indices[j]] += values[j]`` for every j: how one rank sums the sparse payloads that an
    all-gather brought from every rank.

    Args:
        out: contiguous fp32/fp16/bf16 tensor, accumulated in place.
        indices: int32 or int64 flat indices, each in ``[0, out.numel())``.
        values: one value per index, any float dtype (cast to ``out.dtype``).

    Returns:
        ``out``.

    Example::

        >>> sparse_accumulate(torch.zeros(4), torch.tensor([1, 1, 3], dtype=torch.int32), torch.ones(3))
        tensor([0., 2., 0., 1.])
    """
    out.view(-1).index_add_(0, indices.long(), values.to(out.dtype))
    return out


def sparse_mean(
    out: Tensor, indices: Tensor, values: Tensor, world_size: int, clear: Tensor | None = None
) -> Tensor:
    """The mean of ``world_size`` ranks' sparse payloads, written into ``out.view(-1)`` in place.

    1. ``out.view(-1)[clear] = 0`` (the entries the previous mean wrote, say), when ``clear`` is given;
    2. ``out.view(-1)[indices[j]] += values[j]`` for every j, in order (:func:`sparse_accumulate`);
    3. every entry named in ``indices`` is divided by ``world_size``, once however often it is named.

    Other entries are left as they are: a buffer kept between steps needs only last step's entries
    cleared, not a pass over all of it.

    Args:
        out: contiguous fp32/fp16/bf16 tensor, written in place.
        indices: int32 or int64 flat indices, each in ``[0, out.numel())``.
        values: one value per index, any float dtype (cast to ``out.dtype``).
        world_size: the divisor, a positive int.
        clear: int32 or int64 flat indices to zero first, or ``None``.

    Returns:
        ``out``.

    Example::

        >>> out = torch.tensor([0.0, 5.0, 0.0, 7.0])
        >>> sparse_mean(out, torch.tensor([1, 1, 2], dtype=torch.int32), torch.ones(3), 2,
        ...             clear=torch.tensor([1, 3]))
        tensor([0.0000, 1.0000, 0.5000, 0.0000])
    """
    flat = out.view(-1)
    if clear is not None:
        flat.index_fill_(0, clear.long(), 0)
    sparse_accumulate(out, indices, values)
    touched = indices.long()
    flat.index_copy_(0, touched, flat.index_select(0, touched).div_(world_size))  # duplicates: same value
    return out
