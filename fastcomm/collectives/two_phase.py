"""The two-phase exchange of blockwise compressors: compressed reduce-scatter, then compressed all-gather.

Each rank owns one segment. Phase 1 (:func:`start_phase1`) compresses the whole tensor and sends segment
``j`` to rank ``j`` (all-to-all); each rank decodes the ``W`` copies of its own segment in rank order
(:func:`reduce_piece`: that alone is the compressed reduce-scatter). Phase 2 (:func:`start_phase2`)
compresses the average again and all-gathers it. Like a ring allreduce, a rank sends about twice its
compressed tensor whatever the world size.

Pieces (:func:`~fastcomm.collectives._layout.piece_ranges`): piece ``c`` of phase 1 carries sub-range
``c`` of every segment in its own all-to-all, so a rank can reduce, re-compress and all-gather piece ``c``
as soon as it arrives, while later pieces are still on the wire. Blocks are independent, so compressing
piece by piece gives the codes that compressing the whole segment would (stochastic rounding draws from a
per-piece seed).

Rows: row ``r`` of phase 1 is ``x[r * stride : r * stride + length]`` zero-padded to the segment (``stride
= length = segment`` for the all-reduce, whose tensor is zero-padded at its end; ``stride = length = the
output's size`` for a reduce-scatter into equal shards). The padding's residual is dropped.

Collective order: these functions issue their collectives when called, from the caller's thread; the
caller decides when phase 2 runs (the DDP hooks: on a lane thread or in the next hook call), never from a
collective's callback, whose order could differ between ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from fastcomm.collectives._layout import (
    Buffers,
    Timer,
    all_gather_flat,
    block_unit,
    piece_ranges,
    profiled,
    scratch_of,
    segment_layout,
)
from fastcomm.collectives._threads import then, when_done
from fastcomm.collectives.errors import PeerCollectiveError
from fastcomm.collectives.seeds import piece_seed
from fastcomm.compress.protocol import Compressor

__all__ = [
    "Phase1",
    "Phase2Payload",
    "Piece",
    "TwoPhaseLayout",
    "decode_rows",
    "reduce_piece",
    "start_phase1",
    "start_phase2",
]


@dataclass(frozen=True)
class TwoPhaseLayout:
    """How one tensor goes through the two-phase exchange.

    Attributes:
        compressor: a blockwise :class:`~fastcomm.compress.Compressor`.
        segment: elements per rank's segment, a multiple of ``unit``.
        unit: the piece granularity, ``lcm(compressor.block, 8)`` (whole blocks and bytes).
        seed: the stochastic-rounding seed base (the DDP hooks mix in step, bucket, rank, phase and piece).
    """

    compressor: Compressor
    segment: int
    unit: int
    seed: int = 0

    @classmethod
    def of_blocks(cls, compressor: Compressor, numel: int, world_size: int, seed: int = 0) -> TwoPhaseLayout:
        """Segments of whole blocks and bytes: ``ceil(numel / W)`` rounded up to ``lcm(block, 8)``.

        Example::

            >>> TwoPhaseLayout.of_blocks(fastcomm.compress.QuantCompressor(bits=8), 1000, 2).segment
            512
        """
        unit = block_unit(compressor.block)
        return cls(compressor, segment_layout(numel, world_size, unit), unit, seed)


@dataclass
class Piece:
    """Sub-range ``[start, stop)`` of every segment: its phase-1 all-to-all and what it brings."""

    start: int
    stop: int
    received: Tensor  # (W, payload bytes of the piece): row i from rank i
    work: dist.Work


@dataclass
class Phase1:
    """A tensor whose phase 1 is in flight (:func:`start_phase1`).

    ``future`` completes with the exchange's result: the caller's phase 2 (:func:`start_phase2`) or
    reduce-scatter decode sets it. ``timer`` holds the compression time of both phases.
    """

    layout: TwoPhaseLayout
    world_size: int
    pieces: list[Piece]
    timer: Timer
    name: str
    bucket: int | None
    future: torch.futures.Future[Tensor] = field(default_factory=torch.futures.Future)

    def failure(self, collective: str, error: BaseException) -> PeerCollectiveError:
        """The named error of ``collective`` of this exchange, chained to ``error``."""
        failure = PeerCollectiveError(f"{self.name} {collective}", self.bucket, error)
        failure.__cause__ = error
        return failure

    def wait_piece(self, piece: Piece) -> None:
        """Wait for ``piece``'s all-to-all; a failure raises :class:`PeerCollectiveError`."""
        try:
            piece.work.wait()
        except Exception as error:
            raise self.failure("phase-1 all-to-all", error) from error


def _compress_past_the_end(
    compressor: Compressor,
    payload: Tensor,
    tensors: tuple[Tensor, Tensor | None, Tensor | None],
    lo: int,
    hi: int,
    end: int,
    scratch: Callable[[str, int], Tensor],
    seed: int,
) -> None:
    """Compress elements ``[lo, hi)`` of a row whose data ends at ``end < hi``, as if zero padded to ``hi``.

    ``tensors`` is ``(x, residual_out, residual_in)`` (the residuals ``None`` without error feedback).
    Only this piece goes through zero-padded copies (reused buffers); the padding's residual is dropped.
    """
    x, residual_out, residual_in = tensors
    valid = max(0, min(hi, end) - lo)

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


def start_phase1(
    x: Tensor,
    layout: TwoPhaseLayout,
    *,
    residual_out: Tensor | None,
    residual_in: Tensor | None,
    group: dist.ProcessGroup | None,
    chunk_bytes: int,
    seed: int,
    buffers: Buffers,
    name: str,
    bucket: int | None = None,
    stride: int | None = None,
) -> Phase1:
    """Compress ``x`` (+ ``residual_in``) row by row and issue one all-to-all per piece; returns at once.

    Args:
        x: the 1-D tensor. Row ``r`` is ``x[r * stride : r * stride + stride]`` (``stride``: the segment
            by default), zero padded to the segment where ``x`` or the row ends first.
        layout: the compressor and segment.
        residual_out, residual_in: error feedback (like ``x``), or ``None``; may be the same tensor.
        group: the process group (``None``: the default one); ``W`` is its size.
        chunk_bytes: the wanted payload bytes per piece.
        seed: the base of the per-row, per-piece stochastic-rounding seeds.
        buffers: where the send and receive buffers come from.
        name, bucket: how a failure names this exchange (:class:`PeerCollectiveError`).
    """
    world_size = dist.get_world_size(group)
    compressor, segment = layout.compressor, layout.segment
    stride = segment if stride is None else stride
    numel = x.numel()
    timer = Timer()
    with timer, profiled(name, bucket, "phase-1 compress and send"):
        row_bytes = compressor.wire_bytes(segment, x.dtype)
        ranges = piece_ranges(segment, layout.unit, row_bytes, chunk_bytes)
        uint8 = torch.empty(0, dtype=torch.uint8, device=x.device)
        send = buffers.tensor("send", uint8, world_size * row_bytes)
        recv = buffers.tensor("recv", uint8, world_size * row_bytes)
        scratch = scratch_of(buffers, x.device)
        pieces = []
        offset = 0
        # compress piece by piece and send each at once: the link starts after the first piece, not after
        # the whole tensor
        for index, (start, stop) in enumerate(ranges):
            width = compressor.wire_bytes(stop - start, x.dtype)
            piece_send = send[world_size * offset : world_size * (offset + width)].view(world_size, width)
            for row in range(world_size):
                lo, hi = row * stride + start, row * stride + stop
                end = min(numel, row * stride + stride)
                row_seed = piece_seed(seed, index * world_size + row)
                if hi <= end:  # inside the row: compressed in place, residuals read and written there
                    compressor.compress_into(
                        piece_send[row],
                        x[lo:hi],
                        None if residual_out is None else residual_out[lo:hi],
                        None if residual_in is None else residual_in[lo:hi],
                        row_seed,
                    )
                else:
                    _compress_past_the_end(
                        compressor, piece_send[row], (x, residual_out, residual_in), lo, hi, end, scratch,
                        row_seed,
                    )  # fmt: skip
            piece_recv = recv[world_size * offset : world_size * (offset + width)].view(world_size, width)
            work = dist.all_to_all_single(
                piece_recv.view(-1), piece_send.view(-1), group=group, async_op=True
            )
            pieces.append(Piece(start, stop, piece_recv, work))
            offset += width
    return Phase1(layout, world_size, pieces, timer, name, bucket)


def reduce_piece(phase1: Phase1, piece: Piece, out: Tensor, mean: bool) -> None:
    """Decode the ``W`` received copies of ``piece`` into ``out`` in rank order, summed (``mean``: / W).

    ``out`` holds the first ``len(out)`` of the piece's ``stop - start`` elements. Dividing by a power
    of two commutes with every rounding here (barring subnormals), so the mean's division folds into the
    decoded scales instead of a pass over ``out``.
    """
    world_size, compressor = phase1.world_size, phase1.layout.compressor
    fold = mean and world_size & (world_size - 1) == 0
    for source in range(world_size):
        divisor = world_size if fold else 1
        compressor.decompress_into(out, piece.received[source], piece.stop - piece.start, source > 0, divisor)
    if mean and not fold:
        out /= world_size


@dataclass(frozen=True)
class Phase2Payload:
    """One tensor's all-gathered phase-2 payloads (every rank's segment, compressed) and their layout.

    Every rank of the exchange holds the same bytes; :meth:`decode_into` of them gives the bits the
    exchange wrote into its tensor. A hierarchy sends them (``1/ratio`` of the decoded shard) inside the
    node instead.

    Attributes:
        layout: the tensor's :class:`TwoPhaseLayout`.
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
            decode_rows(compressor, rows, out, self.layout.segment, start, stop)
        return finite


def decode_rows(
    compressor: Compressor, rows: Tensor, out: Tensor, segment: int, start: int, stop: int
) -> None:
    """Decode sub-range ``[start, stop)`` of every owner's segment (row ``i``: owner ``i``'s) into ``out``."""
    numel = out.numel()
    for owner in range(rows.shape[0]):
        lo = owner * segment + start
        hi = min(owner * segment + stop, numel)
        if lo < hi:
            compressor.decompress_into(out[lo:hi], rows[owner], stop - start)


@dataclass
class Phase2:
    """What :func:`start_phase2` issued: the payloads (filled as pieces arrive) and the bytes sent."""

    payload: Phase2Payload
    sent_bytes: int


Decoded = Callable[[bool, float], None]


def start_phase2(
    phase1: Phase1,
    out: Tensor,
    mean: Tensor,
    *,
    server_out: Tensor | None,
    server_in: Tensor | None,
    rank: int,
    group: dist.ProcessGroup | None,
    seed: int,
    buffers: Buffers,
    on_issued: Callable[[Phase2], None] | None = None,
    on_decoded: Decoded | None = None,
) -> Phase2:
    """Per piece: wait for phase 1, average this rank's copies, re-compress, all-gather (async), decode.

    Args:
        phase1: the exchange, from :func:`start_phase1` with ``stride`` the segment.
        out: where the mean lands (the tensor of phase 1, in its dtype); ``phase1.future`` completes with
            it once every gathered piece is decoded, or fails with :class:`PeerCollectiveError`.
        mean: fp32 scratch of one segment (this rank's average before re-compression).
        server_out, server_in: the phase-2 (server) error feedback of this rank's segment, or ``None``.
        rank: this rank in ``group``; ``group``: where phase 2 goes (the phase-1 group or a twin of it).
        seed: the base of the per-piece stochastic-rounding seeds.
        buffers: where the row and gathered buffers come from.
        on_issued: called with the :class:`Phase2` once every all-gather is issued, before the future can
            complete (a DDP hook keeps the payloads and counts the traffic there).
        on_decoded: called with (every piece decoded finite, decode seconds) before the future completes.
    """
    layout, timer, world_size = phase1.layout, phase1.timer, phase1.world_size
    compressor, segment = layout.compressor, layout.segment
    with timer:
        row_bytes = compressor.wire_bytes(segment, out.dtype)
        uint8 = phase1.pieces[0].received
        row = buffers.tensor("row", uint8, row_bytes)
        gathered = buffers.tensor("gathered", uint8, world_size * row_bytes)
    decoded: list[torch.futures.Future[tuple[bool, float]]] = []
    placed: list[tuple[int, int, int, int]] = []
    sent_bytes = offset = 0
    for index, piece in enumerate(phase1.pieces):
        start, stop, width = piece.start, piece.stop, piece.received.shape[1]
        phase1.wait_piece(piece)
        with timer, profiled(phase1.name, phase1.bucket, f"phase-2 reduce and compress piece {index}"):
            part = mean[start:stop]
            reduce_piece(phase1, piece, part, mean=True)
            piece_row = row[offset : offset + width]
            compressor.compress_into(
                piece_row,
                part,
                None if server_out is None else server_out[start:stop],
                None if server_in is None else server_in[start:stop],
                piece_seed(seed, index),
            )
            piece_out = gathered[world_size * offset : world_size * (offset + width)]
            try:
                future = all_gather_flat(piece_out, piece_row, group=group, async_op=True).get_future()
            except Exception as error:  # a group already broken raises at once
                raise phase1.failure("phase-2 all-gather", error) from error
        rows = piece_out.view(world_size, width)
        label = (phase1.name, phase1.bucket, f"phase-2 decode piece {index}")
        decoded.append(then(future, _decoder(compressor, rows, out, segment, start, stop, label)))
        placed.append((start, stop, offset, width))
        sent_bytes += 2 * (world_size - 1) * width
        offset += width
    phase1.pieces = []
    result = phase1.future

    def complete(done: torch.futures.Future[list[torch.futures.Future[tuple[bool, float]]]]) -> None:
        try:
            pieces = [piece.value() for piece in done.value()]
        except Exception as error:  # a failed phase-2 all-gather: reaches whoever waits on the future
            result.set_exception(phase1.failure("phase-2 all-gather", error))
            return
        if on_decoded is not None:
            on_decoded(all(finite for finite, _ in pieces), sum(seconds for _, seconds in pieces))
        result.set_result(out)

    issued = Phase2(Phase2Payload(layout, gathered, tuple(placed), world_size), sent_bytes)
    if on_issued is not None:
        on_issued(issued)
    when_done(torch.futures.collect_all(decoded), complete)
    return issued


def _decoder(
    compressor: Compressor,
    rows: Tensor,
    out: Tensor,
    segment: int,
    start: int,
    stop: int,
    label: tuple[str, int | None, str],
) -> Callable[[torch.futures.Future], tuple[bool, float]]:
    """The callback that decodes one gathered piece into ``out``: (finite, seconds it took)."""

    def decode(arrived: torch.futures.Future) -> tuple[bool, float]:
        arrived.value()  # raises the all-gather's error, which completion reports
        timer = Timer()
        with timer, profiled(*label):
            finite = compressor.payload_finite(rows, stop - start, out.dtype)
            decode_rows(compressor, rows, out, segment, start, stop)
        return finite, timer.seconds

    return decode
