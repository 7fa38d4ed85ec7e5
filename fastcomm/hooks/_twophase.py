"""The two-phase compressed allreduce (reduce-scatter, then all-gather) of the quantized and sign hooks.

Each rank owns one segment of the bucket. Phase 1 compresses the whole bucket and sends segment ``j`` to
rank ``j`` (one all-to-all); each rank decompresses the ``W`` copies of its own segment, averages them,
compresses the average again and phase 2 all-gathers the result. Like a ring allreduce, a rank sends about
twice its compressed bucket whatever the world size.

Both collectives of a bucket are issued inside the hook call: phase 1 is waited on there, phase 2 is the
future the hook returns. DDP calls hooks in bucket order on every rank, so gloo and NCCL see the same
collectives in the same order everywhere. (Issuing phase 2 from a callback of phase 1 would let a rank's
phase 2 of bucket ``i`` race its phase 1 of bucket ``i + 1``: the ordering bug that breaks PyTorch's PowerSGD
over gloo.) The cost is that the hook blocks the backward pass for the phase-1 exchange of each bucket.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from fastcomm.hooks._state import CompressedCall, Timer, all_gather_flat, seed_for

__all__ = ["Codec", "two_phase_allreduce"]


@dataclass(frozen=True)
class Codec:
    """A compressor seen by the two-phase allreduce.

    Attributes:
        block: elements per fp32 scale; segments are whole blocks.
        bits: wire bits per element (8, 4, 2 or 1).
        compress: ``(x, residual or None, seed) -> (packed uint8, fp32 scales)``; ``residual`` is updated in
            place to ``x + residual - sent``.
        decompress: ``(packed, scales, numel, dtype) -> values``.
    """

    block: int
    bits: int
    compress: Callable[[Tensor, Tensor | None, int], tuple[Tensor, Tensor]]
    decompress: Callable[[Tensor, Tensor, int, torch.dtype], Tensor]


def _pad(tensor: Tensor, total: int) -> Tensor:
    if tensor.numel() == total:
        return tensor.clone()
    return torch.cat([tensor, tensor.new_zeros(total - tensor.numel())])


def two_phase_allreduce(
    call: CompressedCall, segment: int, codec: Codec, seed: int
) -> torch.futures.Future[Tensor]:
    """Mean over ranks of ``flat`` through ``codec``, with error feedback on both phases.

    1. ``x`` = the bucket zero-padded to ``W * segment``; with error feedback, plus the phase-1 residual.
    2. Compress ``x`` (new phase-1 residual staged), all-to-all the per-segment payloads, wait.
    3. Decompress the ``W`` received copies of this rank's segment in fp32, sum in rank order, divide by
       ``W``; add the phase-2 residual; compress again (new phase-2 residual staged).
    4. All-gather the phase-2 payloads (async); the returned future decompresses them in the bucket's dtype
       and records whether any scale was non-finite (inf/NaN anywhere makes its block's scale non-finite).

    Args:
        call: the hook's state, the bucket's key and entry, the 1-D gradient bucket, world size and rank.
        segment: elements per rank's segment, a multiple of ``codec.block`` and of 8.
        codec: the compressor.
        seed: the stochastic-rounding seed base (mixed with step, bucket, rank and phase).

    Returns:
        A future holding the averaged bucket, in ``flat``'s dtype.
    """
    state, key, entry, flat = call.state, call.key, call.entry, call.flat
    group, world_size, rank = state.process_group, call.world_size, call.rank
    numel, dtype = flat.numel(), flat.dtype
    total = segment * world_size
    data_bytes = segment * codec.bits // 8
    step = state._steps
    timer = Timer()
    with timer:
        x = _pad(flat, total)
        residual = None
        if state.error_feedback:
            residual = _pad(state._current(entry, "residual", flat), total)
        data, scales = codec.compress(x, residual, seed_for(seed, step, key, rank, 1))
        if residual is not None:
            state._stage(key, "residual", residual[:numel])
        send = torch.cat([data.view(world_size, -1), scales.view(world_size, -1).view(torch.uint8)], dim=1)
        recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    with timer:
        mean = torch.zeros(segment, dtype=torch.float32, device=flat.device)
        for source in range(world_size):
            payload = recv[source]
            scales_in = payload[data_bytes:].clone().view(torch.float32)
            mean += codec.decompress(payload[:data_bytes].contiguous(), scales_in, segment, torch.float32)
        mean /= world_size
        entry.segment_start, entry.world_size = rank * segment, world_size
        server = None
        if state.error_feedback:
            server = state._current(entry, "server_residual", mean, segment).clone()
        data2, scales2 = codec.compress(mean, server, seed_for(seed, step, key, rank, 2))
        if server is not None:
            state._stage(key, "server_residual", server)
        row = torch.cat([data2, scales2.view(torch.uint8)])
        gathered = row.new_empty(world_size * row.numel())
    work = all_gather_flat(gathered, row, group=group, async_op=True)
    sent = (world_size - 1) * send.numel() // world_size + (world_size - 1) * row.numel()
    state._count(sent, 2 * (world_size - 1) * numel * flat.element_size() // world_size, timer.seconds, True)

    def decompress(_: torch.futures.Future) -> Tensor:
        decompress_timer = Timer()
        with decompress_timer:
            rows = gathered.view(world_size, -1)
            all_scales = rows[:, data_bytes:].contiguous().view(torch.float32)
            state._note_output(torch.isfinite(all_scales).all())
            out = torch.empty(total, dtype=dtype, device=flat.device)
            for source in range(world_size):
                part = codec.decompress(
                    rows[source, :data_bytes].contiguous(), all_scales[source], segment, dtype
                )
                out[source * segment : (source + 1) * segment] = part
        state._compress_seconds += decompress_timer.seconds
        return out[:numel]

    return work.get_future().then(decompress)
