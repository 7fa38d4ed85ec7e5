"""The two-phase compressed allreduce (reduce-scatter, then all-gather) of the quantized and sign hooks.

Each rank owns one segment of the bucket. Phase 1 compresses the whole bucket and sends segment ``j`` to
rank ``j`` (one all-to-all); each rank decompresses the ``W`` copies of its own segment, averages them,
compresses the average again and phase 2 all-gathers the result. Like a ring allreduce, a rank sends about
twice its compressed bucket whatever the world size.

Pipelined, in a fixed collective order: the hook call of bucket ``i`` issues phase 1 of bucket ``i`` (async),
then waits for phase 1 of bucket ``i - 1`` (usually done while bucket ``i``'s gradients were computed) and
issues its phase 2; the last bucket also finishes its own phase 2 in its call. Every rank therefore issues
``p1(0), p1(1), p2(0), p1(2), p2(1), ..., p1(last), p2(last - 1), p2(last)``, all from hook calls (never from
a callback, whose order could differ between ranks: the bug that breaks PyTorch's PowerSGD over gloo). The
future of bucket ``i`` is completed by its phase-2 callback, which decompresses the gathered payloads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from fastcomm.hooks._state import CompressedCall, PendingPhase, Timer, all_finite, all_gather_flat, seed_for

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


def _padded(tensor: Tensor, total: int) -> Tensor:
    """``tensor`` zero-padded to ``total`` elements (``tensor`` itself when no padding is needed)."""
    if tensor.numel() == total:
        return tensor
    return torch.cat([tensor, tensor.new_zeros(total - tensor.numel())])


class _TwoPhase(PendingPhase):
    """One bucket's two-phase allreduce: phase 1 issued at construction, phase 2 by :meth:`finish`."""

    def __init__(self, call: CompressedCall, segment: int, codec: Codec, seed: int) -> None:
        self.call, self.segment, self.codec, self.seed = call, segment, codec, seed
        state, key, entry, flat = call.state, call.key, call.entry, call.flat
        world_size, rank = call.world_size, call.rank
        numel = flat.numel()
        self.step = state._steps
        self.data_bytes = segment * codec.bits // 8
        self.future: torch.futures.Future[Tensor] = torch.futures.Future()
        self.timer = Timer()
        with self.timer:
            total = segment * world_size
            residual = None
            if state.error_feedback:
                current = state._current(entry, "residual", flat)
                if numel == total:
                    residual = state._staging_copy(key, "residual", current)
                else:
                    residual = _padded(current, total)
            data, scales = codec.compress(
                _padded(flat, total), residual, seed_for(seed, self.step, key, rank, 1)
            )
            if residual is not None:
                state._stage(key, "residual", residual if numel == total else residual[:numel])
            rows = (data.view(world_size, -1), scales.view(world_size, -1).view(torch.uint8))
            row_bytes = rows[0].shape[1] + rows[1].shape[1]
            send = state._wire_buffer(key, "send", data, world_size * row_bytes)
            self.send = torch.cat(rows, dim=1, out=send.view(world_size, row_bytes))
            recv = state._wire_buffer(key, "recv", data, world_size * row_bytes)
            self.recv = recv.view(world_size, row_bytes)
        self.work = dist.all_to_all_single(self.recv, self.send, group=state.process_group, async_op=True)

    def finish(self) -> None:
        """Wait for phase 1, average this rank's segment, re-compress it and issue phase 2 (async)."""
        call, segment, codec = self.call, self.segment, self.codec
        state, key, entry, flat = call.state, call.key, call.entry, call.flat
        world_size, rank, data_bytes = call.world_size, call.rank, self.data_bytes
        numel, dtype = flat.numel(), flat.dtype
        self.work.wait()
        timer = self.timer
        with timer:
            # dividing by a power of two commutes with every rounding here (barring subnormals), so the
            # mean's division folds into the received scales instead of a pass over the segment
            fold = world_size & (world_size - 1) == 0
            mean = None
            for source in range(world_size):
                payload = self.recv[source]
                scales_in = payload[data_bytes:].clone().view(torch.float32)
                if fold:
                    scales_in /= world_size
                part = codec.decompress(payload[:data_bytes], scales_in, segment, torch.float32)
                mean = part if mean is None else mean.add_(part)
            assert mean is not None
            if not fold:
                mean /= world_size
            entry.segment_start, entry.world_size = rank * segment, world_size
            server = None
            if state.error_feedback:
                current = state._current(entry, "server_residual", mean, segment)
                server = state._staging_copy(key, "server_residual", current)
            data2, scales2 = codec.compress(mean, server, seed_for(self.seed, self.step, key, rank, 2))
            if server is not None:
                state._stage(key, "server_residual", server)
            row = torch.cat([data2, scales2.view(torch.uint8)])
            gathered = state._wire_buffer(key, "gathered", row, world_size * row.numel())
        work = all_gather_flat(gathered, row, group=state.process_group, async_op=True)
        sent = (world_size - 1) * self.send.numel() // world_size + (world_size - 1) * row.numel()
        dense = 2 * (world_size - 1) * numel * flat.element_size() // world_size
        state._count(sent, dense, timer.seconds, True)
        self.send = self.recv = None  # type: ignore[assignment]

        def decompress(_: torch.futures.Future) -> Tensor:
            decompress_timer = Timer()
            with decompress_timer:
                rows = gathered.view(world_size, -1)
                all_scales = rows[:, data_bytes:].contiguous().view(torch.float32)
                state._note_output(all_finite(all_scales))
                # segments are whole blocks and whole bytes, so the rows' codes side by side are the codes of
                # the whole padded bucket: one decode, no per-segment copies
                all_codes = rows[:, :data_bytes].contiguous()
                out = codec.decompress(all_codes, all_scales.reshape(-1), segment * world_size, dtype)
            state._compress_seconds += decompress_timer.seconds
            return out[:numel]

        def complete(future: torch.futures.Future) -> None:
            try:
                self.future.set_result(future.value())
            except Exception as error:  # a failed collective or decompression reaches DDP's wait
                self.future.set_exception(error)

        work.get_future().then(decompress).add_done_callback(complete)


def two_phase_allreduce(
    call: CompressedCall, segment: int, codec: Codec, seed: int, last: bool
) -> torch.futures.Future[Tensor]:
    """Mean over ranks of ``flat`` through ``codec``, with error feedback on both phases.

    1. ``x`` = the bucket zero-padded to ``W * segment``; with error feedback, plus the phase-1 residual.
    2. Compress ``x`` (new phase-1 residual staged) and issue the all-to-all of the per-segment payloads.
    3. Issue phase 2 of the bucket before this one, if it is pending (see the module docstring).
    4. Phase 2 (now if ``last``, else in the next hook call): wait for phase 1; decompress the ``W`` received
       copies of this rank's segment in fp32, sum in rank order, divide by ``W``; add the phase-2 residual;
       compress again (new phase-2 residual staged); all-gather the phase-2 payloads (async).
    5. The returned future decompresses them in the bucket's dtype (one decode of all segments) and records
       whether any scale was non-finite (inf/NaN anywhere makes its block's scale non-finite).

    Args:
        call: the hook's state, the bucket's key and entry, the 1-D gradient bucket, world size and rank.
        segment: elements per rank's segment, a multiple of ``codec.block`` and of 8.
        codec: the compressor.
        seed: the stochastic-rounding seed base (mixed with step, bucket, rank and phase).
        last: the bucket is the last of the iteration (``bucket.is_last()``): finish its phase 2 now.

    Returns:
        A future holding the averaged bucket, completed once phase 2 is done.
    """
    state = call.state
    mine = _TwoPhase(call, segment, codec, seed)
    state._flush_pending()
    if last:
        mine.finish()
    else:
        state._pending = mine
    return mine.future
