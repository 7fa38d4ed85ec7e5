"""The two-phase compressed allreduce (reduce-scatter, then all-gather) of the blockwise compressors.

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

- ``overlap_phase2=True`` (CPU buckets): on the group's :class:`~fastcomm.hooks._lane.Lane`.
- ``overlap_phase2=False`` (and GPU buckets): the hook call of bucket ``i`` issues phase 1 of bucket ``i``,
  then finishes bucket ``i - 1``; the last bucket also finishes itself. Every rank issues ``p1(0), p1(1),
  p2(0), p1(2), p2(1), ..., p1(last), p2(last - 1), p2(last)``, all from hook calls.

Never from a collective's callback, whose order could differ between ranks (the bug that breaks PyTorch's
PowerSGD over gloo). Each arriving phase-2 piece is decoded straight into the bucket's buffer by its
callback; the bucket's future completes when every piece is decoded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from fastcomm.compress.protocol import Compressor
from fastcomm.hooks._compression import BucketCall, CompressionState
from fastcomm.hooks._errors import PeerCollectiveError
from fastcomm.hooks._exchange import SecondPhase
from fastcomm.hooks._lane import lane_for
from fastcomm.hooks._options import require_bool
from fastcomm.hooks._threads import then, when_done
from fastcomm.hooks._util import BucketKey, Timer, all_gather_flat, block_unit, seed_for, segment_layout
from fastcomm.hooks._wire import MAX_CHUNKS

__all__ = [
    "Phase1",
    "Phase2Payload",
    "Piece",
    "TwoPhaseLayout",
    "TwoPhaseState",
    "finish_phase2",
    "piece_ranges",
    "schedule_second_phase",
    "start_phase1",
    "two_phase_allreduce",
    "two_phase_bucket",
]


@dataclass(frozen=True)
class TwoPhaseLayout:
    """How one bucket goes through the two-phase allreduce.

    Attributes:
        compressor: a blockwise :class:`~fastcomm.compress.Compressor`.
        segment: elements per rank's segment, a multiple of ``unit``.
        unit: the piece granularity, ``lcm(compressor.block, 8)`` (whole blocks and whole bytes).
        seed: the stochastic-rounding seed base (mixed with step, bucket, rank, phase and piece).
    """

    compressor: Compressor
    segment: int
    unit: int
    seed: int = 0

    @classmethod
    def of_blocks(cls, compressor: Compressor, numel: int, world_size: int, seed: int = 0) -> TwoPhaseLayout:
        """Segments of whole blocks and bytes: ``ceil(numel / W)`` rounded up to ``lcm(block, 8)``."""
        unit = block_unit(compressor.block)
        return cls(compressor, segment_layout(numel, world_size, unit), unit, seed)


class TwoPhaseState(CompressionState):
    """Options shared by the two-phase hooks on top of :class:`CompressionState`; subclasses give a layout.

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
        # bucket key -> its last phase 2's gathered payloads, kept only where this dict is given (the
        # inner state of a hierarchy, whose in-node gather sends them instead of the decoded bucket)
        self.payloads: dict[BucketKey, Phase2Payload] | None = None
        super().__init__(**options)

    def layout(self, numel: int, world_size: int) -> TwoPhaseLayout:
        """The compressor and segment for a bucket of ``numel`` elements over ``world_size`` ranks."""
        raise NotImplementedError(f"{type(self).__name__} must say how its buckets are laid out")


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


def _compress_past_the_end(
    compressor: Compressor,
    payload: Tensor,
    bucket: tuple[Tensor, Tensor | None, Tensor | None],
    lo: int,
    hi: int,
    scratch: Callable[[str, int], Tensor],
    seed: int,
) -> None:
    """Compress elements ``[lo, hi)`` of a bucket that ends before ``hi``, as if zero padded to ``hi``.

    ``bucket`` is ``(x, residual_out, residual_in)``, each the bucket's length (the residuals ``None``
    without error feedback). Only this piece goes through zero-padded copies (reused buffers); the
    padding's residual is dropped, as a padded bucket's would be.
    """
    x, residual_out, residual_in = bucket
    valid = max(0, min(hi, x.numel()) - lo)

    def buffer(name: str, like: Tensor) -> Tensor:
        return scratch(name, (hi - lo) * like.element_size()).view(like.dtype)

    def padded(name: str, source: Tensor | None) -> Tensor | None:
        if source is None:
            return None
        out = buffer(name, source)
        out[:valid].copy_(source[lo : lo + valid])
        out[valid:].zero_()
        return out

    out_piece = None if residual_out is None else buffer("tail_residual_out", residual_out)
    x_piece, in_piece = padded("tail_x", x), padded("tail_residual_in", residual_in)
    compressor.compress_into(payload, x_piece, out_piece, in_piece, seed)
    if out_piece is not None and valid:  # out_piece exists exactly when residual_out does
        assert residual_out is not None
        residual_out[lo : lo + valid].copy_(out_piece[:valid])


def _piece_seed(base: int, index: int) -> int:
    return (base ^ (index * 0x9E3779B97F4A7C15)) % (2**62)


@dataclass
class Piece:
    """Sub-range ``[start, stop)`` of every segment: its phase-1 all-to-all and what it brings."""

    start: int
    stop: int
    received: Tensor  # (W, payload bytes of the piece): row i from rank i
    work: dist.Work


@dataclass(frozen=True)
class Phase2Payload:
    """One bucket's all-gathered phase-2 payloads (every rank's segment, compressed) and their layout.

    Every rank of the exchange holds the same bytes; :meth:`decode_into` of them gives the bits the
    exchange wrote into its bucket. A hierarchy sends them (``1/ratio`` of the decoded shard) inside the
    node instead.

    Attributes:
        layout: the bucket's :class:`TwoPhaseLayout`.
        gathered: the phase-2 all-gather buffer (uint8): for each piece, ``(W, width)`` rows back to back.
        pieces: ``(start, stop, offset, width)`` per piece: its sub-range of every segment, and where its
            rows start in ``gathered`` (``W * offset``) and how wide each row is.
        world_size: ``W``, the exchange's ranks.
    """

    layout: TwoPhaseLayout
    gathered: Tensor
    pieces: tuple[tuple[int, int, int, int], ...]
    world_size: int

    def decode_into(self, out: Tensor, gathered: Tensor) -> bool:
        """Decode ``gathered``, payloads laid out as these (another rank's shard, say), into ``out``.

        Decodes the first ``out.numel()`` elements; returns whether they are finite.
        """
        world_size, compressor, finite = self.world_size, self.layout.compressor, True
        source = gathered.reshape(-1)
        if source.numel() != self.gathered.numel():
            raise ValueError(f"payloads of {source.numel()} bytes for a layout of {self.gathered.numel()}")
        for start, stop, offset, width in self.pieces:
            rows = source[world_size * offset : world_size * (offset + width)].view(world_size, width)
            finite = compressor.payload_finite(rows, stop - start, out.dtype) and finite
            _decode_rows(compressor, rows, out, self.layout.segment, start, stop)
        return finite


@dataclass
class Phase1:
    """A bucket whose phase 1 is in flight (:func:`start_phase1`); :meth:`finish` runs phase 2."""

    call: BucketCall
    layout: TwoPhaseLayout
    step: int
    pieces: list[Piece]
    timer: Timer
    future: torch.futures.Future[Tensor] = field(default_factory=torch.futures.Future)

    def finish(self, group: dist.ProcessGroup | None = None) -> None:
        """:func:`finish_phase2` of this bucket (over ``group``, by default the state's)."""
        finish_phase2(self, group)

    def where(self, collective: str) -> str:
        return f"{type(self.call.state).__name__} {collective}"


def start_phase1(call: BucketCall, layout: TwoPhaseLayout) -> Phase1:
    """Compress the bucket (phase-1 residual staged) and issue one all-to-all per piece; returns at once."""
    state, key, entry, flat, world_size = call.state, call.key, call.entry, call.flat, call.world_size
    compressor, segment = layout.compressor, layout.segment
    store, numel = state.store, flat.numel()
    step = state.accounting.steps
    timer = Timer()
    with timer:
        residual_out = residual_in = None
        if state.error_feedback:
            residual_in = store.current(entry, "residual", flat)
            residual_out = store.spare(key, "residual", residual_in)
        row_bytes = compressor.wire_bytes(segment, flat.dtype)
        ranges = piece_ranges(segment, layout.unit, row_bytes, state.wire_chunk_bytes)
        uint8 = torch.empty(0, dtype=torch.uint8, device=flat.device)
        send = store.buffers.tensor(key, "send", uint8, world_size * row_bytes)
        recv = store.buffers.tensor(key, "recv", uint8, world_size * row_bytes)
        base_seed = seed_for(layout.seed, step, key, call.rank, 1)
        pieces = []
        offset = 0
        # compress piece by piece and send each at once: the link starts after the first piece, not after
        # the whole bucket
        for index, (start, stop) in enumerate(ranges):
            width = compressor.wire_bytes(stop - start, flat.dtype)
            piece_send = send[world_size * offset : world_size * (offset + width)].view(world_size, width)
            for row in range(world_size):
                lo, hi = row * segment + start, row * segment + stop
                seed = _piece_seed(base_seed, index * world_size + row)
                if hi <= numel:  # in the bucket: compressed in place, residuals read and written there
                    compressor.compress_into(
                        piece_send[row],
                        flat[lo:hi],
                        None if residual_out is None else residual_out[lo:hi],
                        None if residual_in is None else residual_in[lo:hi],
                        seed,
                    )
                else:
                    _compress_past_the_end(
                        compressor, piece_send[row], (flat, residual_out, residual_in), lo, hi,
                        store.buffers.scratch(key, flat.device), seed,
                    )  # fmt: skip
            piece_recv = recv[world_size * offset : world_size * (offset + width)].view(world_size, width)
            work = dist.all_to_all_single(
                piece_recv.view(-1), piece_send.view(-1), group=state.process_group, async_op=True
            )
            pieces.append(Piece(start, stop, piece_recv, work))
            offset += width
        if residual_out is not None:
            store.stage(key, "residual", residual_out)
    return Phase1(call, layout, step, pieces, timer)


def finish_phase2(phase1: Phase1, group: dist.ProcessGroup | None = None) -> None:
    """Per piece: wait for phase 1, average this rank's copies, re-compress, issue phase 2 (async).

    Phase 2 goes over ``group``, by default the state's process group. The bucket's future completes once
    every gathered piece is decoded into the bucket (or fails with the collective's error).
    """
    call, layout, timer = phase1.call, phase1.layout, phase1.timer
    state, key, entry, flat = call.state, call.key, call.entry, call.flat
    world_size, rank, store = call.world_size, call.rank, call.state.store
    compressor, segment = layout.compressor, layout.segment
    group = state.process_group if group is None else group
    row_bytes = compressor.wire_bytes(segment, flat.dtype)
    # dividing by a power of two commutes with every rounding here (barring subnormals), so the mean's
    # division folds into the received scales instead of a pass over the segment
    fold = world_size & (world_size - 1) == 0
    with timer:
        fp32 = torch.empty(0, dtype=torch.float32, device=flat.device)
        mean = store.buffers.tensor(key, "mean", fp32, segment)
        store.set_segment(entry, rank * segment, world_size)
        server_in = server_out = None
        if state.error_feedback:
            server_in = store.current(entry, "server_residual", mean, segment)
            server_out = store.spare(key, "server_residual", server_in)
        uint8 = phase1.pieces[0].received
        row = store.buffers.tensor(key, "row", uint8, row_bytes)
        gathered = store.buffers.tensor(key, "gathered", uint8, world_size * row_bytes)
    decoded: list[torch.futures.Future[float]] = []
    placed: list[tuple[int, int, int, int]] = []
    sent_bytes = 0
    offset = 0
    for index, piece in enumerate(phase1.pieces):
        start, stop, received = piece.start, piece.stop, piece.received
        try:
            piece.work.wait()
        except Exception as error:
            raise PeerCollectiveError(phase1.where("phase-1 all-to-all"), call.bucket_index, error) from error
        with timer:
            width = received.shape[1]
            part = mean[start:stop]
            for source in range(world_size):
                divisor = world_size if fold else 1
                compressor.decompress_into(part, received[source], stop - start, source > 0, divisor)
            if not fold:
                part /= world_size
            piece_row = row[offset : offset + width]
            compressor.compress_into(
                piece_row,
                part,
                None if server_out is None else server_out[start:stop],
                None if server_in is None else server_in[start:stop],
                _piece_seed(seed_for(layout.seed, phase1.step, key, rank, 2), index),
            )
            piece_out = gathered[world_size * offset : world_size * (offset + width)]
            try:
                future = all_gather_flat(piece_out, piece_row, group=group, async_op=True).get_future()
            except Exception as error:  # a group already broken raises at once
                where = phase1.where("phase-2 all-gather")
                raise PeerCollectiveError(where, call.bucket_index, error) from error
        decoded.append(then(future, _decoder(phase1, piece_out.view(world_size, width), start, stop)))
        placed.append((start, stop, offset, width))
        sent_bytes += 2 * (world_size - 1) * width
        offset += width
    if server_out is not None:
        store.stage(key, "server_residual", server_out)
    if isinstance(state, TwoPhaseState) and state.payloads is not None:
        # kept before the bucket's future can complete: whoever waits on it finds this step's
        state.payloads[key] = Phase2Payload(layout, gathered, tuple(placed), world_size)
    dense = 2 * (world_size - 1) * flat.numel() * flat.element_size() // world_size
    state.accounting.count(sent_bytes, dense, timer.seconds, True)
    phase1.pieces = []

    def complete(done: torch.futures.Future[list[torch.futures.Future[float]]]) -> None:
        try:
            state.accounting.add_seconds(sum(piece.value() for piece in done.value()))
        except Exception as error:  # a failed phase-2 all-gather: reaches DDP's wait
            failure = PeerCollectiveError(phase1.where("phase-2 all-gather"), call.bucket_index, error)
            failure.__cause__ = error
            phase1.future.set_exception(failure)
        else:
            phase1.future.set_result(flat)

    when_done(torch.futures.collect_all(decoded), complete)


def _decoder(phase1: Phase1, rows: Tensor, start: int, stop: int) -> Callable[[torch.futures.Future], float]:
    """The callback that decodes one gathered piece into the bucket; returns the seconds it took."""
    flat, segment, compressor = phase1.call.flat, phase1.layout.segment, phase1.layout.compressor
    accounting = phase1.call.state.accounting

    def decode(arrived: torch.futures.Future) -> float:
        arrived.value()  # raises the all-gather's error, which completion reports
        timer = Timer()
        with timer:
            accounting.note_output(compressor.payload_finite(rows, stop - start, flat.dtype))
            _decode_rows(compressor, rows, flat, segment, start, stop)
        return timer.seconds

    return decode


def _decode_rows(
    compressor: Compressor, rows: Tensor, out: Tensor, segment: int, start: int, stop: int
) -> None:
    """Decode sub-range ``[start, stop)`` of every owner's segment (row ``i``: owner ``i``'s) into ``out``."""
    numel = out.numel()
    for owner in range(rows.shape[0]):
        lo = owner * segment + start
        hi = min(owner * segment + stop, numel)
        if lo < hi:
            compressor.decompress_into(out[lo:hi], rows[owner], stop - start)


def two_phase_allreduce(call: BucketCall, layout: TwoPhaseLayout) -> torch.futures.Future[Tensor]:
    """Mean over ranks of ``call.flat`` through ``layout.compressor``, with error feedback on both phases.

    1. ``x`` = the bucket zero-padded to ``W * segment``; with error feedback, plus the phase-1 residual.
    2. :func:`start_phase1`: compress ``x`` (new phase-1 residual staged) and issue one all-to-all per
       piece (see the module docstring) of the per-segment payloads.
    3. Finish the bucket before this one, if it is pending (``overlap_phase2=False``).
    4. :func:`finish_phase2` (on the lane with ``overlap_phase2``; else now if ``call.last``, otherwise in
       the next hook call), piece by piece: wait for its phase 1; decompress the ``W`` received copies of
       this rank's sub-range in fp32, summed in rank order, divided by ``W``; add the phase-2 residual;
       compress again (new phase-2 residual staged); all-gather (async).
    5. Each gathered piece is decoded into the bucket's own buffer, in its dtype, and checked for
       non-finite values; the returned future holds the buffer once all pieces are in.

    Returns:
        A future holding the averaged bucket, completed once phase 2 is done.
    """
    return schedule_second_phase(call, lambda: start_phase1(call, layout))


def schedule_second_phase(call: BucketCall, start: Callable[[], SecondPhase]) -> torch.futures.Future[Tensor]:
    """Issue a bucket's first collective (``start()``, now) and schedule its second; return DDP's future.

    Steps 3-4 of :func:`two_phase_allreduce`, for any exchange of two dependent collectives: the bucket
    deferred by the previous hook call is finished after ``start()``, then this one's ``finish`` goes to the
    lane (``overlap_phase2`` and a CPU bucket), or runs now (the last bucket), or is deferred to the next
    hook call. Never from a collective's callback, so every rank issues the same collectives in the same
    order on each group.
    """
    state = call.state
    assert isinstance(state, TwoPhaseState)
    lane = lane_for(state.process_group) if state.overlap_phase2 and call.flat.device.type == "cpu" else None
    mine = start()
    state.flush_pending()
    if lane is not None:
        lane_group = lane.group
        lane.submit(lambda: _finish_on_lane(mine, lane_group))
    elif call.last:
        mine.finish()
    else:
        state.defer(mine)
    # DDP reads a future's value as the tensor; a value() in a callback turns the exception set on
    # mine.future into a real error of the returned future, which DDP's backward raises
    return then(mine.future, _result)


def _finish_on_lane(pending: SecondPhase, group: dist.ProcessGroup) -> None:
    """``pending.finish`` on a lane's thread and group; a failure reaches DDP through the future."""
    try:
        pending.finish(group)
    except Exception as error:  # noqa: BLE001 - handed to whoever waits on the bucket
        if not pending.future.done():
            pending.future.set_exception(error)


def _result(future: torch.futures.Future[Tensor]) -> Tensor:
    return future.value()


def two_phase_bucket(call: BucketCall) -> torch.futures.Future[Tensor]:
    """Compress one bucket of a :class:`TwoPhaseState` hook, in the layout the state gives it."""
    state = call.state
    assert isinstance(state, TwoPhaseState)
    return two_phase_allreduce(call, state.layout(call.flat.numel(), call.world_size))
