"""1-bit sign hook: signs and per-chunk scales in a two-phase exchange (1-bit Adam's compressed allreduce)."""

# No `from __future__ import annotations`: DDP checks a hook's annotations against the real types.
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from fastcomm.collectives import block_unit, segment_layout
from fastcomm.collectives.two_phase import TwoPhaseLayout
from fastcomm.compress.sign import SignCompressor
from fastcomm.hooks.engine.compression import run_compressed
from fastcomm.hooks.engine.options import require_int
from fastcomm.hooks.engine.twophase import TwoPhaseState, two_phase_bucket

__all__ = ["SignState", "sign_hook", "sign_layout"]


class SignState(TwoPhaseState):
    """State of :func:`sign_hook`: chunk size, residuals of both phases (worker and server), statistics.

    Error feedback is what makes 1-bit compression converge (EF-SignSGD, 1-bit Adam); turning it off is
    allowed but rarely useful.

    Args:
        chunk: elements per fp32 scale (the mean magnitude of the chunk), any positive int; smaller buckets
            use one chunk per rank segment. A chunk need not fill whole bytes (bits are packed across chunk
            boundaries): segments and pieces are multiples of ``lcm(chunk, 8)`` elements
            (:func:`sign_layout`), so each piece on the wire is whole bytes and whole chunks.
        error_feedback: per-bucket residuals on both phases.
        start_iter: dense allreduce for the first ``start_iter`` steps (1-bit Adam's warmup stage).
        **options: keyword-only, as for every two-phase hook: ``min_compress_numel`` (buckets with fewer
            elements go dense), ``wire_chunk_bytes``, ``overlap_phase2`` (see
            :class:`~fastcomm.hooks.engine.twophase.TwoPhaseState`) and ``process_group``.

    Example::

        state = fastcomm.SignState(start_iter=100)
        ddp.register_comm_hook(state, fastcomm.sign_hook)
    """

    _OPTIONS = ("chunk", *TwoPhaseState._OPTIONS)

    def __init__(
        self,
        chunk: int = 2048,
        **options: Any,
    ) -> None:
        self.chunk = require_int("chunk", chunk, minimum=1)
        super().__init__(**options)

    def layout(self, numel: int, world_size: int) -> TwoPhaseLayout:
        """The segment and chunk of :func:`sign_layout`, and the sign compressor of that chunk."""
        segment, chunk = sign_layout(numel, world_size, self.chunk)
        return TwoPhaseLayout(SignCompressor(chunk), segment, block_unit(chunk))


def sign_layout(numel: int, world_size: int, chunk: int) -> tuple[int, int]:
    """``(segment, chunk)`` for a bucket: one chunk per segment when a segment fits in ``chunk``.

    The segment is ``ceil(numel / W)`` rounded up to 8 when that is at most ``chunk`` (then the chunk is the
    whole segment), else rounded up to ``lcm(chunk, 8)``.

    Example::

        >>> sign_layout(1000, 2, 2048)
        (504, 504)
    """
    small = segment_layout(numel, world_size, 8)
    if small <= chunk:
        return small, small
    return segment_layout(numel, world_size, block_unit(chunk)), chunk


def sign_hook(state: SignState | None, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    """DDP comm hook: 1-bit compressed allreduce with error feedback on the worker and server side.

    1. Dense allreduce instead before ``start_iter`` or for buckets under ``min_compress_numel``; the
       gradient as is when the world size is 1.
    2. Split the bucket into ``W`` segments (:func:`sign_layout`, zero padded at the end).
    3. Phase 1: ``ops.sign_compress(grad, residual)``: one bit per element and the mean magnitude per chunk;
       the residual keeps ``acc - scale * sign``. All-to-all the segments.
    4. Each rank decompresses the ``W`` copies of its segment, averages them in fp32 and sign-compresses the
       average with its own server residual; phase 2 all-gathers the result, which every rank decompresses.

    A rank sends about ``2 (W-1)/W * numel * (1/8 + 4/chunk)`` bytes: about 1/32 of an fp32 ring
    allreduce, whatever the world size.

    Args:
        state: a :class:`SignState`, or ``None`` for a default one per model.
        bucket: the DDP gradient bucket.

    Returns:
        A future holding the averaged bucket.

    Example::

        ddp.register_comm_hook(fastcomm.SignState(), fastcomm.sign_hook)
    """
    return run_compressed(state, bucket, SignState, two_phase_bucket)
