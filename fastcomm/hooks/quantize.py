"""Quantized allreduce hook: blockwise 8/4/2-bit codes through a two-phase all-to-all, all-gather exchange."""

# No `from __future__ import annotations`: DDP checks a hook's annotations against the real types.
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from fastcomm import reference
from fastcomm.collectives.two_phase import TwoPhaseLayout
from fastcomm.compress.quantize import QuantCompressor
from fastcomm.hooks.engine.compression import run_compressed
from fastcomm.hooks.engine.options import require_bool, require_int
from fastcomm.hooks.engine.twophase import TwoPhaseState, two_phase_bucket

__all__ = ["QuantState", "quantize_hook"]


class QuantState(TwoPhaseState):
    """State of :func:`quantize_hook`: code width, block size, rounding, residuals of both phases, statistics.

    Stochastic rounding draws from ``seed`` mixed with the step, the bucket, the rank and the phase, so ranks
    round independently, and a run restored from a checkpoint rounds exactly as the original did.

    Args:
        bits: code width, 8, 4 or 2.
        block: elements per absmax scale.
        stochastic: unbiased stochastic rounding instead of round-to-nearest.
        seed: base seed of stochastic rounding.
        error_feedback: per-bucket residuals on both phases (what quantization dropped is sent later).
        start_iter: dense allreduce for the first ``start_iter`` steps.
        **options: keyword-only, as for every two-phase hook: ``min_compress_numel`` (buckets with fewer
            elements go dense), ``wire_chunk_bytes``, ``overlap_phase2`` (see
            :class:`~fastcomm.hooks.engine.twophase.TwoPhaseState`) and ``process_group``.

    Example::

        state = fastcomm.QuantState(bits=4, block=128)
        ddp.register_comm_hook(state, fastcomm.quantize_hook)
    """

    _OPTIONS = ("bits", "block", "stochastic", "seed", *TwoPhaseState._OPTIONS)

    def __init__(
        self,
        bits: int = 8,
        block: int = 256,
        stochastic: bool = True,
        seed: int = 0,
        **options: Any,
    ) -> None:
        if require_int("bits", bits) not in reference.QUANT_BITS:
            raise ValueError(f"bits must be one of {reference.QUANT_BITS}, got {bits!r}")
        self.bits = bits
        self.block = require_int("block", block, minimum=1)
        self.stochastic = require_bool("stochastic", stochastic)
        self.seed = require_int("seed", seed)
        self._compressor = QuantCompressor(bits, block, stochastic)
        super().__init__(**options)

    def layout(self, numel: int, world_size: int) -> TwoPhaseLayout:
        """Segments of whole blocks: ``ceil(numel / W)`` rounded up to ``lcm(block, 8)``."""
        return TwoPhaseLayout.of_blocks(self._compressor, numel, world_size, self.seed)


def quantize_hook(state: QuantState | None, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    """DDP comm hook: two-phase quantized allreduce (ring-like traffic) with error feedback.

    1. Dense allreduce instead before ``start_iter`` or for buckets under ``min_compress_numel``; the
       gradient as is when the world size is 1.
    2. Split the bucket into ``W`` segments of whole blocks (``ceil(numel / W)`` rounded up to
       ``lcm(block, 8)``, zero padded at the end).
    3. Phase 1: quantize ``acc = grad + residual`` (``bits`` per element, one fp32 scale per ``block``) and
       keep ``acc - dequantized`` (in fp32, rounded once) as the residual, in one fused pass; all-to-all the
       segments.
    4. Each rank dequantizes the ``W`` copies of its segment, averages them in fp32, adds its phase-2
       residual and quantizes again; phase 2 all-gathers those codes, which every rank dequantizes.

    A rank sends about ``2 (W-1)/W * numel * (bits/8 + 4/block)`` bytes, like a ring allreduce of a
    ``bits``-wide tensor. The error of the result is below one quantization step of each phase (half a step
    each with nearest rounding). A block holding inf/NaN dequantizes to NaN, so GradScaler sees overflow.

    Args:
        state: a :class:`QuantState`, or ``None`` for a default one per model.
        bucket: the DDP gradient bucket.

    Returns:
        A future holding the averaged bucket.

    Example::

        ddp.register_comm_hook(fastcomm.QuantState(bits=8), fastcomm.quantize_hook)
    """
    return run_compressed(state, bucket, QuantState, two_phase_bucket)
