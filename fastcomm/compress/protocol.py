"""The :class:`Compressor` protocol: what a gradient compressor provides to the hooks and to optimizers.

A compressor turns a 1-D float tensor into a *payload* (uint8 bytes of a size fixed by the element count
and dtype alone, so every rank knows every payload's size before any communication), with error feedback:
what the payload does not carry is written to a residual that the caller adds to the next input. Decoding
writes or adds the values back into a tensor. Compressors hold no per-bucket state: residuals live in the
hooks' bucket store (or in whatever tensors an optimizer hands over); ``state_dict`` is for compressors
that learn something of their own across steps.

``block`` says how the hooks exchange the payloads:

* ``block > 0`` (blockwise): the payload of ``x`` is the payloads of its consecutive ``block``-element
  blocks side by side in some fixed layout, so any run of whole blocks (and whole bytes) is compressed and
  decoded on its own. The hooks then use the two-phase exchange (all-to-all, average, re-compress,
  all-gather), whose traffic per rank does not grow with the world size.
* ``block == 0``: the payload belongs to the whole tensor (top-k's selection, for example); the hooks
  all-gather the payloads and every rank decodes all of them.

Compressors whose payloads are *summed* over ranks (linear in the input, like PowerSGD's factors) implement
:class:`AllreduceCompressor` instead: two allreduces per bucket, the second computed from the first's sum,
with sizes that follow from the bucket's parameter shapes alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

__all__ = ["AllreduceCompressor", "AllreducePlan", "Compressor", "all_finite", "scale_all_finite_"]


def all_finite(tensor: Tensor) -> bool:
    """Whether every element is finite.

    fp32: first by its sum, one pass at a third of a min/max pass's cost on CPU (25M elements: 4.5 ms
    against 12.5 on one core). A NaN or inf element makes the sum NaN or inf, so a finite sum settles it; a
    sum that is not finite (a non-finite element, or finite elements whose sum overflows) is decided by
    the min/max pass, as every other dtype is (NaN propagates into both, inf into one).
    ``torch.isfinite(t).all()`` allocates a mask and makes several passes: tens of times slower on CPU.

    Example::

        >>> all_finite(torch.tensor([1.0, float("inf")]))
        False
        >>> all_finite(torch.tensor([3e38, 3e38]))  # the sum overflows; the elements are finite
        True
    """
    if tensor.numel() == 0:
        return True
    flat = tensor.reshape(-1)
    if flat.dtype == torch.float32 and bool(torch.isfinite(flat.sum())):
        return True
    low, high = torch.aminmax(flat)
    return bool(torch.isfinite(low) & torch.isfinite(high))


def scale_all_finite_(tensor: Tensor, factor: float) -> bool:
    """Multiply ``tensor`` by ``factor`` in place and say whether every element was finite, in one pass.

    The pass is torch's fused GradScaler unscale (``torch._amp_foreach_non_finite_check_and_unscale_``):
    ``mul_`` then :func:`all_finite` would read the tensor twice (25M fp32 elements on one core: 4.1 ms
    against 5.1 + 5.5). The products are ``tensor * factor`` in the tensor's dtype (``factor`` rounded to
    fp32 first), as ``tensor.mul_(torch.tensor(factor))`` computes them.

    Example::

        >>> g = torch.tensor([2.0, 4.0])
        >>> scale_all_finite_(g, 0.5), g
        (True, tensor([1., 2.]))
    """
    if tensor.numel() == 0:
        return True
    if not tensor.is_floating_point():
        raise TypeError(f"scale_all_finite_ takes a floating-point tensor, got {tensor.dtype}")
    found = torch.zeros(1, dtype=torch.float32, device=tensor.device)
    scale = torch.full((1,), factor, dtype=torch.float32, device=tensor.device)
    torch._amp_foreach_non_finite_check_and_unscale_([tensor], found, scale)
    return not bool(found.item())


@runtime_checkable
class Compressor(Protocol):
    """A lossy gradient compressor with error feedback (see the module docstring).

    Attributes:
        block: elements per independently decodable block (``0``: the payload is not blockwise).

    Example::

        compressor = fastcomm.compress.SignCompressor(chunk=256)
        x = torch.randn(1024)
        residual = torch.zeros_like(x)
        payload = torch.empty(compressor.wire_bytes(x.numel(), x.dtype), dtype=torch.uint8)
        compressor.compress_into(payload, x, residual, residual, seed=0)  # residual updated in place
        out = torch.empty_like(x)
        compressor.decompress_into(out, payload, x.numel())
        assert torch.allclose(out + residual, x, atol=1e-6)  # error feedback: nothing is lost
    """

    block: int

    def wire_bytes(self, numel: int, dtype: torch.dtype) -> int:
        """Bytes of the payload of ``numel`` elements of ``dtype``."""
        ...

    def compress_into(
        self, payload: Tensor, x: Tensor, residual_out: Tensor | None, residual_in: Tensor | None, seed: int
    ) -> None:
        """Write the payload of ``x + residual_in`` into ``payload`` (``wire_bytes(x.numel())`` uint8).

        With error feedback ``residual_out`` receives ``x + residual_in - decoded payload`` (it may be the
        same tensor as ``residual_in``); both are ``None`` without it. ``seed`` drives any randomness
        (stochastic rounding), so equal inputs and seeds give equal payloads on every rank and on resume.
        """
        ...

    def decompress_into(
        self, out: Tensor, payload: Tensor, payload_numel: int, accumulate: bool = False, divisor: int = 1
    ) -> None:
        """Decode the first ``out.numel()`` of the ``payload_numel`` values ``payload`` holds into ``out``.

        ``accumulate``: add to what ``out`` holds instead of overwriting it. ``divisor``: decode the
        values divided by it (blockwise compressors fold it into their scales).
        """
        ...

    def payload_finite(self, payloads: Tensor, payload_numel: int, dtype: torch.dtype) -> bool:
        """Whether ``payloads`` (one payload of ``payload_numel`` ``dtype`` values per row) decode finite."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """What the compressor learned across steps (``{}`` for a stateless one)."""
        ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        ...


class AllreducePlan(Protocol):
    """How an :class:`AllreduceCompressor` lays out one bucket: what the hook needs to know of it."""

    first_numel: int  # fp32 elements of the first allreduced vector
    second_numel: int  # fp32 elements of the second (0: one allreduce is enough for this bucket)


@runtime_checkable
class AllreduceCompressor(Protocol):
    """A compressor exchanged by two allreduces (sums) of fp32 vectors, the second computed from the first's.

    For each bucket the hook (``fastcomm.hooks.compressor_hook``) runs, with ``x`` the bucket's gradient
    plus its error-feedback residual (fp32, 1-D, parameters back to back):

    1. ``plan = plan(shapes, min_compress_numel)``: sizes from the parameter shapes alone, so every rank
       issues collectives of the same sizes for any bucket layout.
    2. ``first_round(plan, out, x, state, seed)``; ``out`` (``plan.first_numel``) is summed over ranks.
       Optional: a compressor with a method ``first_round_from(plan, out, x, gradient, residual, state,
       seed)`` gets, for fp32 buckets with error feedback, the gradient and the committed residual instead,
       and writes ``x = gradient + residual`` itself (PowerSGD forms it in the pass that computes ``P``).
    3. ``second_round(plan, out, first_sum, x)`` (``first_sum`` may be changed in place); ``out``
       (``plan.second_numel``) is summed over ranks. The hook issues it from its phase-2 lane or from its
       next call, never from a collective's callback.
    4. ``finish(plan, mean, residual, state_out, first_sum, second_sum, world_size)`` writes the mean over
       ranks into ``mean`` and what this rank still owes into ``residual`` (which holds ``x`` on entry;
       ``None`` without error feedback).

    A compressor that keeps state across steps (``keeps_state``) keeps it in a tensor of the bucket's
    layout, each parameter's inside that parameter's own slice: the hooks' bucket store then carries it
    across bucket rebuilds, skipped steps and checkpoints as it does residuals. ``state`` is the committed
    one (zeros at first), ``state_out`` (``None`` if not ``keeps_state``) receives the next, both fp32.

    Example::

        compressor = fastcomm.compress.PowerSGDCompressor(rank=4)
        plan = compressor.plan([torch.Size([64, 32]), torch.Size([64])], min_compress_numel=0)
        first = torch.empty(plan.first_numel)
        compressor.first_round(plan, first, torch.randn(64 * 32 + 64), torch.zeros(64 * 32 + 64), seed=0)
    """

    keeps_state: bool

    def plan(self, shapes: Sequence[torch.Size], min_compress_numel: int) -> AllreducePlan:
        """The layout of a bucket of parameters of these shapes (in bucket order)."""
        ...

    def first_round(self, plan: Any, out: Tensor, x: Tensor, state: Tensor | None, seed: int) -> None:
        """Write the first vector of ``x`` into ``out``; ``seed`` is the same on every rank."""
        ...

    def second_round(self, plan: Any, out: Tensor, first_sum: Tensor, x: Tensor) -> None:
        """Write the second vector into ``out`` from every rank's first summed (``first_sum``) and ``x``."""
        ...

    def finish(
        self,
        plan: Any,
        mean: Tensor,
        residual: Tensor | None,
        state_out: Tensor | None,
        first_sum: Tensor,
        second_sum: Tensor,
        world_size: int,
    ) -> None:
        """Write the mean over ranks into ``mean``, the new residual into ``residual`` and the state."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """What the compressor learned across steps of its own (``{}`` for a stateless one)."""
        ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        ...
