"""The two-phase compressed allreduce (reduce-scatter, then all-gather) of the quantized and sign hooks.

Each rank owns one segment of the bucket. Phase 1 compresses the whole bucket and sends segment ``j`` to
rank ``j`` (all-to-all); each rank decompresses the ``W`` copies of its own segment, averages them,
compresses the average again and phase 2 all-gathers the result. Like a ring allreduce, a rank sends about
twice its compressed bucket whatever the world size.

Pieces: a segment is cut into pieces of whole blocks (about ``wire_chunk_bytes`` of payload each). Piece
``c`` of phase 1 carries sub-range ``c`` of every segment in its own all-to-all, so a rank can average,
re-compress and all-gather piece ``c`` as soon as it arrives, while later pieces are still on the wire;
and several collectives in flight keep a TCP link busy (one large transfer does not: see
:mod:`fastcomm.hooks._wire`). Blocks are independent, so compressing piece by piece gives the codes that
compressing the whole segment would (stochastic rounding draws from a per-piece seed). Phase 1 compresses
and sends piece by piece too, so the link starts working after the first piece's compression.

Collective order is fixed on every rank. Phase 1 of each bucket is issued by its hook call, on the state's
process group, like every other collective there (DDP's own, a SyncBatchNorm's, dense buckets). Phase 2:

- ``overlap_phase2=True`` (CPU buckets): a background thread, one per process group, finishes the buckets in
  the order their hook calls submitted them, each piece as soon as its phase 1 arrives, and issues phase 2
  on a second process group over the same ranks that nothing else uses. Each group then sees one thread
  issue collectives in bucket order. Phase 2 of the first bucket no longer waits for the second bucket's
  hook call (on a 1 Gbit/s link that idle gap was ~55 ms of a 0.35 s step).
- ``overlap_phase2=False`` (and GPU buckets): the hook call of bucket ``i`` issues phase 1 of bucket ``i``,
  then finishes bucket ``i - 1``; the last bucket also finishes itself. Every rank issues ``p1(0), p1(1),
  p2(0), p1(2), p2(1), ..., p1(last), p2(last - 1), p2(last)``, all from hook calls.

Never from a collective's callback, whose order could differ between ranks (the bug that breaks PyTorch's
PowerSGD over gloo). Each arriving phase-2 piece is decoded straight into the bucket's buffer by its
callback; the bucket's future completes when every piece is decoded.
"""

from __future__ import annotations

import queue
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from fastcomm.hooks._errors import PeerCollectiveError
from fastcomm.hooks._options import require_bool
from fastcomm.hooks._state import (
    CompressedCall,
    CompressionState,
    PendingPhase,
    Timer,
    all_finite,
    all_gather_flat,
    seed_for,
)
from fastcomm.hooks._wire import MAX_CHUNKS

__all__ = ["Codec", "TwoPhaseState", "piece_ranges", "two_phase_allreduce"]


class TwoPhaseState(CompressionState):
    """Options shared by the two-phase hooks (quantized and sign) on top of :class:`CompressionState`.

    Args:
        overlap_phase2: finish each bucket (average, re-compress, all-gather) on a background thread as soon
            as its phase 1 arrives, issuing phase 2 on a second process group over the same ranks (made
            once, at the first compressed bucket). ``False``, or buckets on a GPU: the next hook call
            finishes the bucket before it. Either way every rank issues the same collectives in the same
            order on each group.
        **options: the :class:`CompressionState` options.

    Example::

        state = fastcomm.QuantState(bits=8, overlap_phase2=False)  # everything from DDP's hook thread
    """

    _OPTIONS = (*CompressionState._OPTIONS, "overlap_phase2")

    def __init__(self, *, overlap_phase2: bool = True, **options: Any) -> None:
        self.overlap_phase2 = require_bool("overlap_phase2", overlap_phase2)
        super().__init__(**options)


class _Lane:
    """A thread that finishes two-phase buckets in submission order, with its own process group.

    Only this thread issues collectives on ``group`` and jobs run one at a time in the order the hook calls
    submitted them, which is the same on every rank: the order of collectives on ``group`` is too. Phase 1
    stays on the user's group, issued from DDP's hook thread like every other collective there.
    """

    def __init__(self, parent: dist.ProcessGroup) -> None:
        self.group = dist.new_group(
            ranks=dist.get_process_group_ranks(parent),
            backend=dist.get_backend(parent),
            use_local_synchronization=True,  # only the parent's ranks run this hook
            group_desc="fastcomm_phase2",
            timeout=_timeout_of(parent),
        )
        self.jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="fastcomm-phase2", daemon=True)
        self.thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        self.jobs.put(job)

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            job()  # jobs report their own failures through their bucket's future


def _timeout_of(group: dist.ProcessGroup) -> timedelta | None:
    """The collective timeout of ``group``'s CPU backend, or ``None`` (new_group's default) if unknown.

    The lane's group takes its parent's: a group made without one gets gloo's 30 minutes, and a peer
    stopped between phase 1 and phase 2 would hang the survivor that long instead of failing.
    """
    try:
        return group._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):
        return None


# process group -> its lane, or None where none could be made. The entry keeps the group alive until exit
# (destroy_process_group shuts both groups down). A version holding groups weakly, ending a lane's thread
# when its group was freed, aborted ranks at exit in our tests.
_LANES: dict[dist.ProcessGroup, _Lane | None] = {}
_LANES_LOCK = threading.Lock()


def _lane_for(state: TwoPhaseState) -> _Lane | None:
    """The lane of ``state``'s process group, made at first use; ``None`` if a group cannot be made.

    A failure is remembered (one warning, no retry per bucket); it is the same on every rank, so all ranks
    fall back to finishing in the next hook call together.
    """
    parent = state.process_group if state.process_group is not None else dist.group.WORLD
    with _LANES_LOCK:
        if parent in _LANES:
            return _LANES[parent]
        lane: _Lane | None
        try:
            lane = _Lane(parent)
        except (RuntimeError, ValueError) as error:
            warnings.warn(
                f"fastcomm: no second process group for overlapped phase 2 ({error}); phase 2 is issued "
                f"from the next hook call instead",
                RuntimeWarning,
                stacklevel=3,
            )
            lane = None
        _LANES[parent] = lane
        return lane


@dataclass(frozen=True)
class Codec:
    """A compressor seen by the two-phase allreduce.

    Attributes:
        block: elements per fp32 scale; pieces and segments are whole blocks.
        bits: wire bits per element (8, 4, 2 or 1).
        compress: ``(x, residual_out, residual_in, seed) -> (packed uint8, fp32 scales)``. With error
            feedback ``residual_out`` receives ``x + residual_in - sent`` (the two may be the same tensor);
            both are ``None`` without it.
        decompress_into: ``(out, packed, scales, accumulate)``: decode ``out.numel()`` values into ``out``
            (added to it when ``accumulate``); the payload may be longer than ``out`` needs.
    """

    block: int
    bits: int
    compress: Callable[[Tensor, Tensor | None, Tensor | None, int], tuple[Tensor, Tensor]]
    decompress_into: Callable[[Tensor, Tensor, Tensor, bool], None]


def piece_ranges(segment: int, unit: int, payload_bytes: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """Element ranges ``[start, stop)`` cutting a segment into pieces of whole ``unit``\\ s.

    Args:
        segment: elements per segment, a multiple of ``unit``.
        unit: the granularity, ``lcm(block, 8)``: whole blocks and whole bytes.
        payload_bytes: compressed bytes of one segment (codes and scales).
        chunk_bytes: the wanted payload per piece; at most ``MAX_CHUNKS`` pieces.

    Example::

        >>> piece_ranges(1024, 256, 1040, 512)
        [(0, 256), (256, 512), (512, 768), (768, 1024)]
    """
    units = max(1, segment // unit)
    count = max(1, min(units, MAX_CHUNKS, -(-payload_bytes // max(1, chunk_bytes))))
    edges = [units * i // count * unit for i in range(count + 1)]
    edges[-1] = segment
    return list(zip(edges[:-1], edges[1:], strict=True))


def _padded(tensor: Tensor, total: int) -> Tensor:
    """``tensor`` zero-padded to ``total`` elements (``tensor`` itself when no padding is needed)."""
    if tensor.numel() == total:
        return tensor
    return torch.cat([tensor, tensor.new_zeros(total - tensor.numel())])


def _piece_seed(base: int, index: int) -> int:
    return (base ^ (index * 0x9E3779B97F4A7C15)) % (2**62)


class _TwoPhase(PendingPhase):
    """One bucket's two-phase allreduce: phase 1 issued at construction, phase 2 by :meth:`finish`."""

    def __init__(self, call: CompressedCall, segment: int, codec: Codec, seed: int, unit: int) -> None:
        self.call, self.segment, self.codec, self.seed = call, segment, codec, seed
        state, key, entry, flat = call.state, call.key, call.entry, call.flat
        world_size, rank = call.world_size, call.rank
        numel = flat.numel()
        bits, block = codec.bits, codec.block
        self.step = state._steps
        self.future: torch.futures.Future[Tensor] = torch.futures.Future()
        self.timer = Timer()
        with self.timer:
            total = segment * world_size
            residual_out = residual_in = None
            if state.error_feedback:
                current = state._current(entry, "residual", flat)
                if numel == total:
                    residual_in, residual_out = current, state._spare(key, "residual", current)
                else:
                    residual_in = residual_out = _padded(current, total)
            x_rows = _padded(flat, total).view(world_size, segment)
            out_rows = None if residual_out is None else residual_out.view(world_size, segment)
            in_rows = None if residual_in is None else residual_in.view(world_size, segment)
            data_bytes, scale_bytes = segment * bits // 8, segment // block * 4
            row_bytes = data_bytes + scale_bytes
            self.ranges = piece_ranges(segment, unit, row_bytes, state.wire_chunk_bytes)
            uint8 = torch.empty(0, dtype=torch.uint8, device=flat.device)
            send = state._wire_buffer(key, "send", uint8, world_size * row_bytes)
            recv = state._wire_buffer(key, "recv", uint8, world_size * row_bytes)
            base_seed = seed_for(seed, self.step, key, rank, 1)
            self.pieces: list[tuple[int, int, int, Tensor, dist.Work]] = []
            offset = 0
            # compress piece by piece and send each at once: the link starts after the first piece, not after
            # the whole bucket
            for index, (start, stop) in enumerate(self.ranges):
                data_width = (stop - start) * bits // 8
                width = data_width + (stop - start) // block * 4
                piece_send = send[world_size * offset : world_size * (offset + width)].view(world_size, width)
                for row in range(world_size):
                    data, scales = codec.compress(
                        x_rows[row, start:stop],
                        None if out_rows is None else out_rows[row, start:stop],
                        None if in_rows is None else in_rows[row, start:stop],
                        _piece_seed(base_seed, index * world_size + row),
                    )
                    piece_send[row, :data_width].copy_(data)
                    piece_send[row, data_width:].copy_(scales.view(torch.uint8))
                piece_recv = recv[world_size * offset : world_size * (offset + width)].view(world_size, width)
                work = dist.all_to_all_single(
                    piece_recv.view(-1), piece_send.view(-1), group=state.process_group, async_op=True
                )
                self.pieces.append((start, stop, data_width, piece_recv, work))
                offset += width
            if residual_out is not None:
                state._stage(key, "residual", residual_out if numel == total else residual_out[:numel])
        self.row_bytes = row_bytes

    def finish(self, group: dist.ProcessGroup | None = None) -> None:
        """Per piece: wait for phase 1, average this rank's copies, re-compress, issue phase 2 (async).

        Phase 2 goes over ``group``, by default the state's process group.
        """
        call, segment, codec = self.call, self.segment, self.codec
        state, key, entry, flat = call.state, call.key, call.entry, call.flat
        world_size, rank, row_bytes = call.world_size, call.rank, self.row_bytes
        numel = flat.numel()
        group = state.process_group if group is None else group
        timer = self.timer
        # dividing by a power of two commutes with every rounding here (barring subnormals), so the mean's
        # division folds into the received scales instead of a pass over the segment
        fold = world_size & (world_size - 1) == 0
        with timer:
            fp32 = torch.empty(0, dtype=torch.float32, device=flat.device)
            mean = state._wire_buffer(key, "mean", fp32, segment)
            entry.segment_start, entry.world_size = rank * segment, world_size
            server_in = server_out = None
            if state.error_feedback:
                server_in = state._current(entry, "server_residual", mean, segment)
                server_out = state._spare(key, "server_residual", server_in)
            row = state._wire_buffer(key, "row", self.pieces[0][3], row_bytes)
            gathered = state._wire_buffer(key, "gathered", self.pieces[0][3], world_size * row_bytes)
        decoded: list[torch.futures.Future[float]] = []
        sent_bytes = 0
        offset = 0
        for index, (start, stop, data_width, piece_recv, work) in enumerate(self.pieces):
            self._wait_phase1(work)
            with timer:
                width = piece_recv.shape[1]
                part = mean[start:stop]
                for source in range(world_size):
                    payload = piece_recv[source]
                    scales_in = payload[data_width:].clone().view(torch.float32)
                    if fold:
                        scales_in /= world_size
                    codec.decompress_into(part, payload[:data_width], scales_in, source > 0)
                if not fold:
                    part /= world_size
                data2, scales2 = codec.compress(
                    part,
                    None if server_out is None else server_out[start:stop],
                    None if server_in is None else server_in[start:stop],
                    _piece_seed(seed_for(self.seed, self.step, key, rank, 2), index),
                )
                piece_row = row[offset : offset + width]
                piece_row[:data_width].copy_(data2)
                piece_row[data_width:].copy_(scales2.view(torch.uint8))
                piece_out = gathered[world_size * offset : world_size * (offset + width)]
                future = self._issue_phase2(piece_out, piece_row, group)
            decoder = self._decoder(piece_out.view(world_size, width), start, stop, data_width)
            decoded.append(future.then(decoder))
            sent_bytes += 2 * (world_size - 1) * width
            offset += width
        if server_out is not None:
            state._stage(key, "server_residual", server_out)
        dense = 2 * (world_size - 1) * numel * flat.element_size() // world_size
        state._count(sent_bytes, dense, timer.seconds, True)
        self.pieces = []

        def complete(done: torch.futures.Future[list[torch.futures.Future[float]]]) -> None:
            try:
                state._add_seconds(sum(piece.value() for piece in done.value()))
            except Exception as error:  # a failed phase-2 all-gather: reaches DDP's wait
                failure = PeerCollectiveError(self._where("phase-2 all-gather"), call.bucket_index, error)
                failure.__cause__ = error
                self.future.set_exception(failure)
            else:
                self.future.set_result(flat)

        torch.futures.collect_all(decoded).add_done_callback(complete)

    def finish_on(self, lane: _Lane) -> None:
        """:meth:`finish` on the lane's thread and group; a failure reaches DDP through the future."""
        try:
            self.finish(lane.group)
        except Exception as error:  # noqa: BLE001 - handed to whoever waits on the bucket
            if not self.future.done():
                self.future.set_exception(error)

    def _where(self, collective: str) -> str:
        return f"{type(self.call.state).__name__} {collective}"

    def _wait_phase1(self, work: dist.Work) -> None:
        """Wait for a phase-1 all-to-all piece; its failure raised as :class:`PeerCollectiveError`."""
        try:
            work.wait()
        except Exception as error:
            where, bucket = self._where("phase-1 all-to-all"), self.call.bucket_index
            raise PeerCollectiveError(where, bucket, error) from error

    def _issue_phase2(
        self, out: Tensor, row: Tensor, group: dist.ProcessGroup | None
    ) -> torch.futures.Future:
        """Issue a phase-2 all-gather piece (async); a group already broken raises at once."""
        try:
            return all_gather_flat(out, row, group=group, async_op=True).get_future()
        except Exception as error:
            where, bucket = self._where("phase-2 all-gather"), self.call.bucket_index
            raise PeerCollectiveError(where, bucket, error) from error

    def _decoder(
        self, rows: Tensor, start: int, stop: int, data_width: int
    ) -> Callable[[torch.futures.Future], float]:
        """The callback that decodes one gathered piece into the bucket; returns the seconds it took."""
        flat, segment, codec, state = self.call.flat, self.segment, self.codec, self.call.state
        numel = flat.numel()

        def decode(arrived: torch.futures.Future) -> float:
            arrived.value()  # raises the all-gather's error, which completion reports
            timer = Timer()
            with timer:
                scales = rows[:, data_width:].contiguous().view(torch.float32)
                state._note_output(all_finite(scales))
                for owner in range(rows.shape[0]):
                    lo = owner * segment + start
                    hi = min(owner * segment + stop, numel)
                    if lo < hi:
                        codec.decompress_into(flat[lo:hi], rows[owner, :data_width], scales[owner], False)
            return timer.seconds

        return decode


def two_phase_allreduce(
    call: CompressedCall, segment: int, codec: Codec, seed: int, last: bool, unit: int
) -> torch.futures.Future[Tensor]:
    """Mean over ranks of ``flat`` through ``codec``, with error feedback on both phases.

    1. ``x`` = the bucket zero-padded to ``W * segment``; with error feedback, plus the phase-1 residual.
    2. Compress ``x`` (new phase-1 residual staged) and issue one all-to-all per piece (see the module
       docstring) of the per-segment payloads.
    3. Finish the bucket before this one, if it is pending (``overlap_phase2=False``).
    4. Finishing (on the phase-2 thread with ``overlap_phase2``; else now if ``last``, otherwise in the next
       hook call), piece by piece: wait for its phase 1;
       decompress the ``W`` received copies of this rank's sub-range in fp32, summed in rank order, divided
       by ``W``; add the phase-2 residual; compress again (new phase-2 residual staged); all-gather (async).
    5. Each gathered piece is decoded into the bucket's own buffer, in its dtype, and checked for
       non-finite scales (inf/NaN anywhere makes its block's scale non-finite); the returned future holds
       the buffer once all pieces are in.

    Args:
        call: the hook's state, the bucket's key and entry, the 1-D gradient bucket, world size and rank.
        segment: elements per rank's segment, a multiple of ``unit``.
        codec: the compressor.
        seed: the stochastic-rounding seed base (mixed with step, bucket, rank, phase and piece).
        last: the bucket is the last of the iteration (``bucket.is_last()``): finish it now.
        unit: the piece granularity, ``lcm(codec.block, 8)`` (or the whole segment).

    Returns:
        A future holding the averaged bucket, completed once phase 2 is done.
    """
    state = call.state
    assert isinstance(state, TwoPhaseState)
    lane = _lane_for(state) if state.overlap_phase2 and call.flat.device.type == "cpu" else None
    mine = _TwoPhase(call, segment, codec, seed, unit)
    state._flush_pending()
    if lane is not None:
        lane.submit(lambda: mine.finish_on(lane))
    elif last:
        mine.finish()
    else:
        state._pending = mine
    # DDP reads a future's value as the tensor; a value() in a callback turns the exception set on
    # mine.future into a real error of the returned future, which DDP's backward raises
    return mine.future.then(_result)


def _result(future: torch.futures.Future[Tensor]) -> Tensor:
    return future.value()
