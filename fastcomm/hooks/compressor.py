"""The hook of any :class:`~fastcomm.compress.Compressor`: error feedback, store and exchange for free.

A compressor registered by name (a row of ``fastcomm.hooks.HOOKS`` naming its factory, added by
:func:`~fastcomm.hooks.registry.add_compressor`) is served by :func:`compressor_hook` with a
:class:`CompressorState`: a blockwise compressor (``block > 0``) through the two-phase allreduce, any
other by one all-gather of every rank's payload, decoded and averaged on every rank; an
:class:`~fastcomm.compress.AllreduceCompressor` (PowerSGD) by its two allreduces
(:mod:`fastcomm.hooks.engine.rounds`).
"""

# No `from __future__ import annotations`: DDP checks a hook's annotations against the real types.
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from fastcomm.collectives import Timer, then
from fastcomm.collectives.errors import collective_value
from fastcomm.collectives.gather import compress_row, decode_mean
from fastcomm.collectives.two_phase import TwoPhaseLayout
from fastcomm.compress.protocol import AllreduceCompressor, Compressor
from fastcomm.hooks.engine.compression import BucketCall, gather_payloads, run_compressed
from fastcomm.hooks.engine.reshard import same_value
from fastcomm.hooks.engine.rounds import allreduce_rounds
from fastcomm.hooks.engine.twophase import TwoPhaseState, two_phase_allreduce

__all__ = ["CompressorState", "compressor_hook"]


class CompressorState(TwoPhaseState):
    """State of :func:`compressor_hook`: the compressor, residuals, step accounting, statistics.

    Args:
        compressor: any :class:`~fastcomm.compress.Compressor` or
            :class:`~fastcomm.compress.AllreduceCompressor`.
        **options: the :class:`~fastcomm.hooks.engine.twophase.TwoPhaseState` options (``error_feedback``,
            ``start_iter``, ``min_compress_numel``, ``wire_chunk_bytes``, ``overlap_phase2``,
            ``process_group``).

    Raises:
        TypeError: ``compressor`` does not provide the protocol.

    Example::

        state = fastcomm.hooks.CompressorState(fastcomm.compress.QuantCompressor(bits=8), start_iter=10)
        ddp.register_comm_hook(state, fastcomm.hooks.compressor_hook)
    """

    _OPTIONS = ("compressor", *TwoPhaseState._OPTIONS)

    def __init__(self, compressor: Compressor | AllreduceCompressor, **options: Any) -> None:
        if not isinstance(compressor, (Compressor, AllreduceCompressor)):
            name = type(compressor).__name__
            raise TypeError(
                f"compressor must provide fastcomm.compress.Compressor or AllreduceCompressor, got {name}"
            )
        self.compressor = compressor
        super().__init__(**options)

    def layout(self, numel: int, world_size: int) -> TwoPhaseLayout:
        """Segments of whole blocks and bytes: ``ceil(numel / W)`` rounded up to ``lcm(block, 8)``."""
        return TwoPhaseLayout.of_blocks(self.compressor, numel, world_size)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "compressor": self.compressor.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.compressor.load_state_dict(state_dict.get("compressor", {}))
        super().load_state_dict(state_dict)

    @classmethod
    def _merge(cls, states: Sequence[dict[str, Any]], world_size: int) -> tuple[dict[str, Any], list[str]]:
        """:meth:`CompressionState._merge` (residuals re-partitioned) and the compressor's own state.

        A compressor's ``state_dict`` is what it learned across steps, not per-bucket state (residuals
        live in the store). The same on every old rank: kept. Different: old rank 0's, said in the log
        line (the protocol gives no rule to merge it).
        """
        merged, notes = super()._merge(states, world_size)
        learned = [state.get("compressor", {}) for state in states]
        merged["compressor"] = learned[0]
        if learned[0]:
            if all(same_value(learned[0], other) for other in learned[1:]):
                notes.append("compressor state: the same on every old rank, kept")
            else:
                notes.append("compressor state: differs across the old ranks; old rank 0's is used")
        return merged, notes


def compressor_hook(state: CompressorState, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    """DDP comm hook: mean over ranks through ``state.compressor``, with error feedback.

    1. Dense allreduce instead before ``start_iter`` or for buckets under ``min_compress_numel``; the
       gradient as is when the world size is 1.
    2. An :class:`~fastcomm.compress.AllreduceCompressor`: its two allreduces
       (:mod:`fastcomm.hooks.engine.rounds`).
       Blockwise compressors: the two-phase allreduce (:mod:`fastcomm.hooks.engine.twophase`), residuals on
       both phases.
    3. Others: compress ``grad + residual`` (new residual staged), all-gather every rank's payload, decode
       them in rank order into the bucket (the first overwrites, the others add, each divided by ``W``).

    Args:
        state: a :class:`CompressorState` (a compressor hook has no default state).
        bucket: the DDP gradient bucket.

    Returns:
        A future holding the averaged bucket.

    Example::

        state = fastcomm.register(ddp, "mycompressor")  # added by fastcomm.hooks.add_compressor
    """
    if state is None:
        raise TypeError("compressor_hook needs a CompressorState: a compressor has no default")
    return run_compressed(state, bucket, CompressorState, _compressor_bucket)


def _compressor_bucket(call: BucketCall) -> torch.futures.Future[Tensor]:
    state = call.state
    assert isinstance(state, CompressorState)
    if isinstance(state.compressor, AllreduceCompressor):
        return allreduce_rounds(call, state.compressor)
    if state.compressor.block > 0:
        return two_phase_allreduce(call, state.layout(call.flat.numel(), call.world_size))
    return _all_gather_allreduce(call, state.compressor)


def _all_gather_allreduce(call: BucketCall, compressor: Compressor) -> torch.futures.Future[Tensor]:
    """Step 3 of :func:`compressor_hook`."""
    state, key, entry, flat, world_size = call.state, call.key, call.entry, call.flat, call.world_size
    store = state.store
    timer = Timer()
    with timer:
        residual = current = None
        if state.error_feedback:
            current = store.current(entry, "residual", flat)
            residual = store.spare(key, "residual", current)
        row = compress_row(compressor, flat, residual, current, store.buffers.keyed(key))
        if residual is not None:
            store.stage(key, "residual", residual)
    gathered, future = gather_payloads(call, row, timer.seconds)
    bucket_index = call.bucket_index

    def decompress(arrived: torch.futures.Future[Tensor]) -> Tensor:
        collective_value(arrived, "compressor_hook", bucket_index)
        decode_timer = Timer()
        with decode_timer:
            state.accounting.note_output(decode_mean(compressor, gathered, flat, world_size))
        state.accounting.add_seconds(decode_timer.seconds)
        return flat

    return then(future, decompress)
