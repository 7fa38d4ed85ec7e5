"""Quantized allreduce hook: blockwise 8/4/2-bit codes through a two-phase all-to-all, all-gather exchange."""

# No `from __future__ import annotations`: DDP checks a hook's annotations against the real types.
import math

import torch
import torch.distributed as dist
from torch import Tensor

from fastcomm import ops, reference
from fastcomm.hooks._options import require_bool, require_int
from fastcomm.hooks._state import CompressedCall, begin_compressed, segment_layout
from fastcomm.hooks._twophase import Codec, TwoPhaseState, two_phase_allreduce
from fastcomm.hooks._wire import DEFAULT_CHUNK_BYTES

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
        min_compress_numel: buckets with fewer elements go dense.
        wire_chunk_bytes: bytes per peer of each chunk a collective is split into (see
            :class:`~fastcomm.hooks._state.CompressionState`).
        overlap_phase2: finish each bucket on a background thread, with phase 2 on a second process group
            over the same ranks, as soon as its phase 1 arrives (CPU buckets); else in the next hook call
            (see :class:`~fastcomm.hooks._twophase.TwoPhaseState`).
        process_group: the group to reduce over; ``None`` for the default group.

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
        *,
        error_feedback: bool = True,
        start_iter: int = 0,
        min_compress_numel: int = 1024,
        wire_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        overlap_phase2: bool = True,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        if require_int("bits", bits) not in reference.QUANT_BITS:
            raise ValueError(f"bits must be one of {reference.QUANT_BITS}, got {bits!r}")
        self.bits = bits
        self.block = require_int("block", block, minimum=1)
        self.stochastic = require_bool("stochastic", stochastic)
        self.seed = require_int("seed", seed)
        super().__init__(
            error_feedback=error_feedback,
            start_iter=start_iter,
            min_compress_numel=min_compress_numel,
            wire_chunk_bytes=wire_chunk_bytes,
            overlap_phase2=overlap_phase2,
            process_group=process_group,
        )

    def codec(self) -> Codec:
        """The blockwise quantizer as the two-phase allreduce uses it."""
        bits, block, stochastic = self.bits, self.block, self.stochastic

        def compress(
            x: Tensor, residual_out: Tensor | None, residual_in: Tensor | None, seed: int
        ) -> tuple[Tensor, Tensor]:
            return ops.quantize_blockwise(
                x, bits, block, stochastic, seed, residual=residual_out, residual_source=residual_in
            )

        def decompress_into(out: Tensor, codes: Tensor, scales: Tensor, accumulate: bool) -> None:
            ops.dequantize_blockwise_into(out, codes, scales, bits, block, accumulate)

        return Codec(block=block, bits=bits, compress=compress, decompress_into=decompress_into)


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
    call = begin_compressed(state, bucket, QuantState)
    if not isinstance(call, CompressedCall):
        return call
    options = call.state
    assert isinstance(options, QuantState)
    unit = math.lcm(options.block, 8)
    segment = segment_layout(call.flat.numel(), call.world_size, unit)
    return two_phase_allreduce(call, segment, options.codec(), options.seed, bucket.is_last(), unit)
