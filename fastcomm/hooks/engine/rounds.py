"""The DDP side of an :class:`~fastcomm.compress.AllreduceCompressor`'s two allreduces (PowerSGD's).

The exchange is :mod:`fastcomm.collectives.rounds`. Per bucket this module forms ``x`` = gradient +
residual (fp32) with the residual and the compressor's state staged in the bucket store, seeds the
first round the same on every rank, counts the traffic, and lets
:func:`~fastcomm.hooks.engine.twophase.schedule_second_phase` decide where the second allreduce is issued (the
phase-2 lane, the next hook call, or now for the last bucket), exactly as the two-phase hooks' phase 2.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fastcomm.collectives import ring_bytes
from fastcomm.collectives import rounds as exchange
from fastcomm.collectives.rounds import Rounds
from fastcomm.compress.protocol import AllreduceCompressor
from fastcomm.hooks.engine.compression import BucketCall
from fastcomm.hooks.engine.twophase import schedule_second_phase
from fastcomm.hooks.engine.util import seed_for

__all__ = ["allreduce_rounds", "allreduce_rounds_bucket", "start_rounds"]

# the bucket-layout tensor an AllreduceCompressor keeps across steps (PowerSGD's warm-start Q's)
STATE_TENSOR = "compressor_state"


def start_rounds(call: BucketCall, compressor: AllreduceCompressor) -> Rounds:
    """``x``, the staged residual and state, the first vector and its allreduce; returns at once."""
    state, key, entry, flat = call.state, call.key, call.entry, call.flat
    store, numel = state.store, flat.numel()
    plan = compressor.plan([p.shape for p in call.params], state.min_compress_numel)
    fp32 = torch.empty(0, dtype=torch.float32, device=flat.device)
    residual = fused = None
    if state.error_feedback:
        current = store.current(entry, "residual", fp32, numel)
        residual = store.spare(key, "residual", current)
        # a compressor with first_round_from forms x = gradient + residual in its own first pass
        first_round_from = getattr(compressor, "first_round_from", None)
        if flat.dtype == torch.float32 and first_round_from is not None:
            fused = (first_round_from, flat, current)
        else:
            torch.add(flat, current, out=residual)  # x, turned into the new residual by finish
        store.stage(key, "residual", residual)
        x = residual
    else:
        x = flat.float()
    state_in = state_out = None
    if compressor.keeps_state:
        state_in = store.current(entry, STATE_TENSOR, fp32, numel)
        state_out = store.spare(key, STATE_TENSOR, state_in)
        store.stage(key, STATE_TENSOR, state_out)
    world_size = call.world_size

    def issued(rounds: Rounds) -> None:
        sent = ring_bytes(rounds.plan.first_numel + rounds.plan.second_numel, 4, world_size)
        dense = ring_bytes(flat.numel(), flat.element_size(), world_size)
        state.accounting.count(sent, dense, rounds.timer.seconds, compressed=True)

    def decoded(finite: bool, seconds: float) -> None:
        state.accounting.note_output(finite)
        state.accounting.add_seconds(seconds)

    return exchange.start_rounds(
        compressor,
        plan,
        x,
        flat,
        residual=residual,
        state=(state_in, state_out),
        # the same seed on every rank: random starts must agree (PowerSGD's Q)
        seed=seed_for(0, state.accounting.steps, key, 0, 1),
        group=state.process_group,
        buffers=store.buffers.keyed(key),
        name=type(state).__name__,
        bucket=call.bucket_index,
        fused=fused,
        on_issued=issued,
        on_decoded=decoded,
    )


def allreduce_rounds(call: BucketCall, compressor: AllreduceCompressor) -> torch.futures.Future[Tensor]:
    """Mean over ranks of ``call.flat`` through ``compressor`` by two allreduces (module docstring).

    Returns:
        The future DDP waits on, holding the averaged bucket once the second allreduce is decoded.
    """
    return schedule_second_phase(call, lambda: start_rounds(call, compressor))


def allreduce_rounds_bucket(call: BucketCall) -> torch.futures.Future[Tensor]:
    """:func:`allreduce_rounds` with the compressor of ``call.state`` (a ``run_compressed`` callback)."""
    compressor = getattr(call.state, "compressor", None)
    if not isinstance(compressor, AllreduceCompressor):
        raise TypeError(f"{type(call.state).__name__} has no AllreduceCompressor: {compressor!r}")
    return allreduce_rounds(call, compressor)
