"""PowerSGD as a named hook: :class:`PowerSGDState` and :func:`powersgd_hook`.

The algorithm is :class:`~fastcomm.compress.PowerSGDCompressor`'s; the exchange (two allreduces per
bucket, the second issued from the phase-2 lane or the next hook call, never from a callback) is
:mod:`fastcomm.hooks.engine.rounds`'; residuals and warm-start ``Q``'s live in the bucket store, so bucket
rebuilds, GradScaler's skipped steps and ``state_dict()`` resumes work as for every other hook.
``fastcomm.register(ddp, "powersgd", rank=4)`` builds a :class:`PowerSGDState` and registers this hook.
"""

# No `from __future__ import annotations`: DDP checks a hook's annotations against the real types.
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from fastcomm.compress.powersgd import PowerSGDCompressor
from fastcomm.hooks.compressor import CompressorState
from fastcomm.hooks.engine.compression import run_compressed
from fastcomm.hooks.engine.rounds import allreduce_rounds_bucket
from fastcomm.hooks.engine.twophase import TwoPhaseState

__all__ = ["PowerSGDState", "powersgd_hook"]


class PowerSGDState(CompressorState):
    """State of :func:`powersgd_hook`: PowerSGD's options, residuals, warm-start ``Q``'s, statistics.

    Args:
        rank: the approximation's rank (columns of ``P`` and ``Q``).
        warm_start: start each step's power iteration from the last step's ``Q``.
        orthogonalization: ``"qr"`` (``torch.linalg.qr``, measured 3x faster on CPU at rank 4) or
            ``"gram_schmidt"``.
        **options: the :class:`~fastcomm.hooks.engine.twophase.TwoPhaseState` options: ``error_feedback``,
            ``start_iter`` (dense allreduce for the first steps), ``min_compress_numel`` (buckets and
            parameters with fewer elements go dense), ``overlap_phase2`` (the second allreduce from the
            phase-2 thread on a second process group; ``False``: from the next hook call),
            ``process_group``.

    Raises:
        ValueError: a bad option, naming it and its value.

    Example::

        state = fastcomm.PowerSGDState(rank=4, start_iter=10)
        ddp.register_comm_hook(state, fastcomm.powersgd_hook)
    """

    _OPTIONS = ("rank", "warm_start", "orthogonalization", *TwoPhaseState._OPTIONS)

    def __init__(
        self, rank: int = 4, *, warm_start: bool = True, orthogonalization: str = "qr", **options: Any
    ) -> None:
        super().__init__(PowerSGDCompressor(rank, warm_start, orthogonalization), **options)

    @property
    def rank(self) -> int:
        return self.compressor.rank

    @property
    def warm_start(self) -> bool:
        return self.compressor.warm_start

    @property
    def orthogonalization(self) -> str:
        return self.compressor.orthogonalization

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """:meth:`CompressorState.load_state_dict`, also of a checkpoint that ``register(ddp, "powersgd")``
        saved as a ``CompressorState`` serving a PowerSGD compressor (the same state under its old name)."""
        super().load_state_dict(_as_powersgd_state(state_dict))

    @classmethod
    def merge_state_dicts(
        cls, states: Sequence[dict[str, Any]], world_size: int, rank: int
    ) -> tuple[dict[str, Any], str]:
        """:meth:`CompressorState.merge_state_dicts`, taking old ``CompressorState`` PowerSGD dicts too."""
        return super().merge_state_dicts([_as_powersgd_state(s) for s in states], world_size, rank)


def _as_powersgd_state(state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` as a :class:`PowerSGDState`'s when it is a ``CompressorState``'s over PowerSGD."""
    options = state_dict.get("options", {})
    compressor = options.get("compressor") if isinstance(options, dict) else None
    if state_dict.get("type") != "CompressorState" or not isinstance(compressor, PowerSGDCompressor):
        return state_dict
    renamed = {key: value for key, value in options.items() if key != "compressor"}
    renamed.update(
        rank=compressor.rank, warm_start=compressor.warm_start, orthogonalization=compressor.orthogonalization
    )
    return {**state_dict, "type": "PowerSGDState", "options": renamed}


def powersgd_hook(state: PowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    """DDP comm hook: PowerSGD's rank-``r`` mean over ranks, with error feedback and warm start.

    1. Dense allreduce before ``start_iter`` or for buckets under ``min_compress_numel``; the gradient as
       is when the world size is 1.
    2. ``M`` = gradient + residual; one allreduce of the bucket's dense elements (1-D parameters, small
       ones, matrices the factors would not shrink) and every ``P = M Q`` side by side.
    3. Orthonormalize each ``P``, ``Q = M^T P``; one allreduce of every ``Q`` (phase-2 lane or next call).
    4. The bucket becomes ``P Q^T / W`` and the dense mean; residual ``M - P Q^T / W``; ``Q / W`` warm-starts
       the next step.

    Args:
        state: a :class:`PowerSGDState`, or ``None`` for a per-model default (rank 4).
        bucket: the DDP gradient bucket.

    Returns:
        A future holding the averaged bucket.

    Example::

        ddp.register_comm_hook(fastcomm.PowerSGDState(rank=2), fastcomm.powersgd_hook)
    """
    return run_compressed(state, bucket, PowerSGDState, allreduce_rounds_bucket)
