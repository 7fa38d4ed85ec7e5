"""PowerSGD (Vogels et al., 2019): rank-``r`` factors of each matrix gradient, summed by two allreduces.

Each parameter of two or more dimensions, viewed as an ``n x m`` matrix ``M`` (its first dimension by the
rest), is sent as two thin factors when that is worth it (``(n + m) r < n m`` and at least
``min_compress_numel`` elements); everything else of the bucket goes densely in the first allreduce.

1. ``P = M Q`` for every compressed matrix, ``Q`` (``m x r``) being last step's (warm start) or random:
   ``torch.randn(m, r)`` from a generator seeded with the hook's seed plus the matrix's index among the
   bucket's compressed matrices (the same on every rank); the first vector is the dense elements then
   every ``P``, summed over ranks.
2. Each summed ``P`` is orthonormalized (its columns; ``torch.linalg.qr`` or Gram-Schmidt), then
   ``Q = M^T P``; the second vector is every ``Q``, summed over ranks.
3. The mean is ``P (Q_sum / W)^T`` for the compressed matrices and ``first_sum / W`` for the dense
   elements; the residual is ``M - P (Q_sum / W)^T`` (zero for dense elements), and ``Q_sum / W`` is kept
   as the next step's warm start, in the first ``m r`` elements of the parameter's slice of the state.

``Q`` is held transposed (``r x m``, row-major) in the second vector and the state: on CPU (MKL, one
thread) ``P^T M`` took 9 ms for a 4096x4096 ``M`` where ``M^T P`` took 210 ms, and ``M (Q^T)^T`` 12 ms
where ``M Q`` took 22 ms.

The mean's projection ``P P^T`` depends only on the span of ``P``, so both orthogonalizations give the same
result up to rounding; on CPU at the sizes of a 25M-parameter MLP (``P`` of 4096x4, 4096x4, 1024x4)
``qr`` took 210 us per step, Gram-Schmidt 620 us (the default is ``qr``).
"""

from __future__ import annotations

import functools
import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from fastcomm import ops

__all__ = ["ORTHOGONALIZATIONS", "PowerSGDCompressor", "PowerSGDPlan", "orthogonalize_"]

ORTHOGONALIZATIONS = ("qr", "gram_schmidt")
# the state tensors finish() wrote, by id: (a weak reference to the tensor, the plan it was written for),
# each zero outside that plan's Q's. Not an attribute of the tensor: torch.save would pickle it with the
# tensor, and torch.load(weights_only=True) (torch's default) refuses a checkpoint holding a plan object.
_CLEAN: dict[int, tuple[weakref.ReferenceType[Tensor], PowerSGDPlan]] = {}


def _clean_for(tensor: Tensor) -> PowerSGDPlan | None:
    """The plan ``tensor`` was last written for by :meth:`PowerSGDCompressor.finish`, else ``None``."""
    found = _CLEAN.get(id(tensor))
    return found[1] if found is not None and found[0]() is tensor else None


def _mark_clean(tensor: Tensor, plan: PowerSGDPlan) -> None:
    key = id(tensor)
    _CLEAN[key] = (weakref.ref(tensor, lambda _ref: _CLEAN.pop(key, None)), plan)


@dataclass(frozen=True)
class MatrixSlot:
    """One compressed parameter: its ``n x m`` view at ``offset`` of the bucket and its factors' places."""

    offset: int  # in the bucket
    rows: int  # n
    cols: int  # m
    p_offset: int  # of its P (n x r) in the first vector
    q_offset: int  # of its Q, transposed (r x m), in the second vector


@dataclass(frozen=True)
class PowerSGDPlan:
    """The layout of one bucket: dense spans (sent as they are), compressed matrices, vector sizes."""

    rank: int
    dense: tuple[tuple[int, int], ...]  # (offset in the bucket, numel), in bucket order
    matrices: tuple[MatrixSlot, ...]
    dense_numel: int  # the first vector starts with the dense elements, back to back
    first_numel: int
    second_numel: int


@functools.lru_cache(maxsize=1024)
def _plan(shapes: tuple[tuple[int, ...], ...], rank: int, min_compress_numel: int) -> PowerSGDPlan:
    dense: list[tuple[int, int]] = []
    grid: list[tuple[int, int, int]] = []
    offset = 0
    for shape in shapes:
        numel = math.prod(shape)
        rows = shape[0] if len(shape) >= 2 else 0
        cols = numel // rows if rows else 0
        if len(shape) >= 2 and numel >= min_compress_numel and (rows + cols) * rank < numel:
            grid.append((offset, rows, cols))
        elif numel:
            if dense and dense[-1][0] + dense[-1][1] == offset:  # neighbours merge into one copy
                dense[-1] = (dense[-1][0], dense[-1][1] + numel)
            else:
                dense.append((offset, numel))
        offset += numel
    dense_numel = sum(numel for _, numel in dense)
    p_offset, q_offset = dense_numel, 0
    matrices = []
    for start, rows, cols in grid:
        matrices.append(MatrixSlot(start, rows, cols, p_offset, q_offset))
        p_offset += rows * rank
        q_offset += cols * rank
    return PowerSGDPlan(rank, tuple(dense), tuple(matrices), dense_numel, p_offset, q_offset)


def orthogonalize_(p: Tensor, method: str = "qr") -> Tensor:
    """Make the columns of ``p`` (``n x r``, fp32) orthonormal in place; returns ``p``.

    ``"gram_schmidt"``: modified Gram-Schmidt, a zero column stays zero (no division by zero).
    ``"qr"``: the ``Q`` of ``torch.linalg.qr`` (reduced).

    Example::

        p = orthogonalize_(torch.randn(100, 4))
        assert torch.allclose(p.T @ p, torch.eye(4), atol=1e-5)
    """
    if method == "qr":
        return p.copy_(torch.linalg.qr(p).Q)
    if method != "gram_schmidt":
        raise ValueError(f"orthogonalization must be one of {ORTHOGONALIZATIONS}, got {method!r}")
    tiny = torch.finfo(p.dtype).tiny
    for i in range(p.shape[1]):
        column = p[:, i]
        column.div_(torch.linalg.vector_norm(column).clamp_min(tiny))
        if i + 1 < p.shape[1]:
            rest = p[:, i + 1 :]
            rest.sub_(torch.outer(column, column @ rest))
    return p


@dataclass(frozen=True)
class PowerSGDCompressor:
    """PowerSGD factors of a bucket's matrices, the rest dense: an :class:`AllreduceCompressor`.

    Args:
        rank: columns of ``P`` and ``Q`` (the approximation's rank).
        warm_start: start each step's power iteration from last step's ``Q`` (kept in the state); else from
            a fresh random ``Q`` each step.
        orthogonalization: ``"qr"`` (``torch.linalg.qr``) or ``"gram_schmidt"``.

    Raises:
        ValueError: an option of the wrong type or out of range, naming it.

    Example::

        state = fastcomm.register(ddp, "powersgd", rank=4, start_iter=10)
    """

    rank: int = 4
    warm_start: bool = True
    orthogonalization: str = "qr"

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"rank must be a positive int, got {self.rank!r}")
        if not isinstance(self.warm_start, bool):
            raise ValueError(f"warm_start must be a bool, got {self.warm_start!r}")
        if self.orthogonalization not in ORTHOGONALIZATIONS:
            raise ValueError(
                f"orthogonalization must be one of {ORTHOGONALIZATIONS}, got {self.orthogonalization!r}"
            )

    @property
    def keeps_state(self) -> bool:
        return self.warm_start

    def plan(self, shapes: Sequence[torch.Size], min_compress_numel: int) -> PowerSGDPlan:
        """Dense spans and compressed matrices of a bucket of these parameter shapes (cached)."""
        return _plan(tuple(tuple(int(d) for d in s) for s in shapes), self.rank, min_compress_numel)

    def first_round(
        self, plan: PowerSGDPlan, out: Tensor, x: Tensor, state: Tensor | None, seed: int
    ) -> None:
        """Dense elements of ``x``, then ``P = M Q`` of every matrix (``Q`` warm or drawn from ``seed``)."""
        _copy_dense(plan, out, x)
        self._project(plan, out, x, None, None, state, seed)

    def first_round_from(
        self,
        plan: PowerSGDPlan,
        out: Tensor,
        x: Tensor,
        gradient: Tensor,
        residual: Tensor,
        state: Tensor | None,
        seed: int,
    ) -> None:
        """:meth:`first_round` of ``x = gradient + residual``, written into ``x`` as it goes (all fp32).

        Each matrix's sum is formed by the same pass that multiplies it by ``Q``
        (:func:`fastcomm.ops.powersgd_project`), so the hook need not form ``x`` in a pass of its own.
        """
        for offset, numel in plan.dense:
            span = slice(offset, offset + numel)
            torch.add(gradient[span], residual[span], out=x[span])
        _copy_dense(plan, out, x)
        self._project(plan, out, x, gradient, residual, state, seed)

    def _project(
        self,
        plan: PowerSGDPlan,
        out: Tensor,
        x: Tensor,
        gradient: Tensor | None,
        residual: Tensor | None,
        state: Tensor | None,
        seed: int,
    ) -> None:
        rank = plan.rank
        for index, slot in enumerate(plan.matrices):
            q_t = self._start_q_t(slot, rank, state, seed + index, x.device)
            p = out[slot.p_offset : slot.p_offset + slot.rows * rank].view(slot.rows, rank)
            ops.powersgd_project(
                p,
                _matrix(x, slot),
                q_t.contiguous(),
                None if gradient is None else _matrix(gradient, slot),
                None if residual is None else _matrix(residual, slot),
            )

    def _start_q_t(
        self, slot: MatrixSlot, rank: int, state: Tensor | None, seed: int, device: torch.device
    ) -> Tensor:
        """``Q^T`` (``r x m``) to start from: the warm one, else a random draw."""
        if state is not None:
            q_t = state[slot.offset : slot.offset + slot.cols * rank].view(rank, slot.cols)
            if bool(q_t.any()):
                return q_t
        # the same draw on every rank; a warm start begins here too (and again if its Q became all zero)
        generator = torch.Generator().manual_seed(seed % (2**63))
        return torch.randn(slot.cols, rank, generator=generator).to(device).T

    def second_round(self, plan: PowerSGDPlan, out: Tensor, first_sum: Tensor, x: Tensor) -> None:
        """Orthonormalize each summed ``P`` in place in ``first_sum``; write ``Q^T = P^T M`` into ``out``."""
        rank = plan.rank
        for slot in plan.matrices:
            p = first_sum[slot.p_offset : slot.p_offset + slot.rows * rank].view(slot.rows, rank)
            orthogonalize_(p, self.orthogonalization)
            q_t = out[slot.q_offset : slot.q_offset + slot.cols * rank].view(rank, slot.cols)
            ops.powersgd_back_project(q_t, p, _matrix(x, slot))

    def finish(
        self,
        plan: PowerSGDPlan,
        mean: Tensor,
        residual: Tensor | None,
        state_out: Tensor | None,
        first_sum: Tensor,
        second_sum: Tensor,
        world_size: int,
    ) -> None:
        """Mean ``P (Q_sum / W)^T``, dense ``first_sum / W``; residual ``M - P (Q_sum / W)^T``; warm ``Q``."""
        second_sum.div_(world_size)
        rank = plan.rank
        position = 0
        for offset, numel in plan.dense:
            mean[offset : offset + numel] = first_sum[position : position + numel] / world_size
            if residual is not None:
                residual[offset : offset + numel] = 0
            position += numel
        if state_out is not None and _clean_for(state_out) is not plan:
            # zero outside the Q's once per buffer and plan: a buffer this finish wrote for the same plan is
            # zero there already (a pass over a bucket-sized tensor saved each step)
            state_out.zero_()
        for slot in plan.matrices:
            p = first_sum[slot.p_offset : slot.p_offset + slot.rows * rank].view(slot.rows, rank)
            q_t = second_sum[slot.q_offset : slot.q_offset + slot.cols * rank].view(rank, slot.cols)
            target = _matrix(mean, slot)
            if mean.dtype == torch.float32:
                ops.powersgd_expand(target, p, q_t, None if residual is None else _matrix(residual, slot))
            else:
                approx = p @ q_t
                target.copy_(approx)
                if residual is not None:
                    _matrix(residual, slot).sub_(approx)
            if state_out is not None:
                state_out[slot.offset : slot.offset + slot.cols * rank] = q_t.reshape(-1)
        if state_out is not None:
            _mark_clean(state_out, plan)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        del state_dict  # stateless: the warm-start Q's live in the hooks' bucket store


def _matrix(flat: Tensor, slot: MatrixSlot) -> Tensor:
    return flat[slot.offset : slot.offset + slot.rows * slot.cols].view(slot.rows, slot.cols)


def _copy_dense(plan: PowerSGDPlan, out: Tensor, x: Tensor) -> None:
    position = 0
    for offset, numel in plan.dense:
        out[position : position + numel] = x[offset : offset + numel]
        position += numel
