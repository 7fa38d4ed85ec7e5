"""Compressed all-reduce, reduce-scatter and all-gather of a caller's own tensors (no DDP, no buckets).

Each takes any :class:`~fastcomm.compress.Compressor` (an :class:`~fastcomm.compress.AllreduceCompressor`
for :func:`all_reduce` too), an optional :class:`Residual` owned by the caller (error feedback: what
compression left out is added to the next call's tensor), a process group, and ``async_op`` as
``torch.distributed`` does. The exchanges are the ones the DDP hooks use (:mod:`.two_phase`,
:mod:`.gather`, :mod:`.rounds`), so the results are the hooks' to the bit for the same inputs and seeds.

Collective order: every rank must call these in the same order, as with any collective. An exchange of two
dependent collectives (a blockwise compressor's all-reduce, or PowerSGD's) issues its first when called;
with ``async_op=True`` on CPU its second goes out from the group's lane (a thread and a twin process
group over the same ranks, :mod:`._lane`) as soon as the first arrives, else from :meth:`CompressedWork.wait`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from fastcomm.collectives import gather, rounds, two_phase
from fastcomm.collectives._lane import SecondCollective, finish_on_lane, lane_for
from fastcomm.collectives._layout import DEFAULT_CHUNK_BYTES, FreshBuffers, block_unit, segment_layout
from fastcomm.collectives._threads import when_done
from fastcomm.collectives.errors import collective_value
from fastcomm.collectives.residual import Residual
from fastcomm.collectives.seeds import exchange_seed
from fastcomm.collectives.traffic import Traffic, ring_bytes
from fastcomm.compress.protocol import AllreduceCompressor, Compressor

__all__ = ["CompressedWork", "all_gather", "all_reduce", "reduce_scatter"]

_OPS = (dist.ReduceOp.AVG, dist.ReduceOp.SUM)


class CompressedWork:
    """The handle an ``async_op=True`` call returns, like ``torch.distributed``'s ``Work``.

    :meth:`wait` issues the exchange's second collective if nothing has yet (a GPU tensor, or no lane),
    waits, and raises :class:`~fastcomm.PeerCollectiveError` if a collective failed. :meth:`get_future`
    completes once the result is in the tensor; where the second collective waits for :meth:`wait`, call
    that first.
    """

    def __init__(self, future: torch.futures.Future, pending: SecondCollective | None = None) -> None:
        self._future, self._pending = future, pending

    def wait(self) -> bool:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.finish()
        self._future.wait()
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future

    def is_completed(self) -> bool:
        return self._future.done()


def _rank_in(group: dist.ProcessGroup | None) -> int:
    """This process's rank in ``group``, asked of the group itself: a group that ``torch.distributed`` did
    not make (a torchft quorum's, made again at every quorum: :mod:`fastcomm.ft`) works as one it made."""
    return dist.get_rank() if group is None else group.rank()


def _then_return(done: torch.futures.Future, tensor: Tensor) -> Tensor:
    done.value()  # raises the exchange's failure, a PeerCollectiveError
    return tensor


def _chain(
    future: torch.futures.Future, fn: Callable[[torch.futures.Future], Tensor]
) -> torch.futures.Future:
    """``fn``'s result on ``future``'s completion, in a future whose failure keeps its exception's type.

    (An exception raised in a ``then`` callback reaches ``wait()`` as a plain ``RuntimeError``; one set
    on the future with ``set_exception`` keeps its type: :class:`PeerCollectiveError` stays one.)
    """
    result: torch.futures.Future = torch.futures.Future()

    def settle(done: torch.futures.Future) -> None:
        try:
            value = fn(done)
        except Exception as error:  # noqa: BLE001 - handed to whoever waits, with its type
            result.set_exception(error)
        else:
            result.set_result(value)

    when_done(future, settle)
    return result


def _check(tensor: Tensor, name: str, op: dist.ReduceOp | None = None) -> Tensor:
    if not isinstance(tensor, Tensor) or not tensor.is_floating_point():
        raise TypeError(f"{name} must be a floating-point torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous (it is reduced in place); pass {name}.contiguous()")
    if op is not None and op not in _OPS:
        raise ValueError(f"op must be dist.ReduceOp.AVG or dist.ReduceOp.SUM, got {op!r}")
    return tensor.view(-1)


def _count(traffic: Traffic | None, sent: int, dense: int) -> None:
    if traffic is not None:
        traffic.add(sent, dense)


def _finish(
    future: torch.futures.Future, pending: SecondCollective | None, flat: Tensor, op: dist.ReduceOp,
    async_op: bool, residual: Residual | None, group: dist.ProcessGroup | None,
) -> CompressedWork | None:  # fmt: skip
    """Scale for SUM, schedule the second collective, and wait (sync) or hand back the work (async)."""
    if op == dist.ReduceOp.SUM:
        world_size = dist.get_world_size(group)

        def scaled(done: torch.futures.Future) -> Tensor:
            return collective_value(done, "fastcomm.collectives", None).mul_(world_size)

        future = _chain(future, scaled)
    if residual is not None:
        residual.hold_until(future)
    if pending is not None and async_op and flat.device.type == "cpu":
        lane = lane_for(group)
        if lane is not None:
            lane_group, second = lane.group, pending
            lane.submit(lambda: finish_on_lane(second, lane_group))
            pending = None
    work = CompressedWork(future, pending)
    if async_op:
        return work
    work.wait()
    return None


def all_reduce(
    tensor: Tensor,
    compressor: Compressor | AllreduceCompressor,
    *,
    residual: Residual | None = None,
    op: dist.ReduceOp = dist.ReduceOp.AVG,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    seed: int = 0,
    shapes: Sequence[torch.Size] | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    traffic: Traffic | None = None,
) -> CompressedWork | None:
    """Mean (or sum) over ranks of ``tensor``, in place, through ``compressor``.

    1. A blockwise compressor (``block > 0``): the two-phase exchange (compressed all-to-all of segments,
       average, re-compress, all-gather), error feedback on both phases.
    2. Another :class:`~fastcomm.compress.Compressor`: every rank's payload all-gathered, decoded in rank
       order on every rank.
    3. An :class:`~fastcomm.compress.AllreduceCompressor`: its two allreduces of fp32 vectors, planned
       from ``shapes`` (default: ``[tensor.shape]``).

    Args:
        tensor: a contiguous float tensor, the same size on every rank; overwritten with the result.
        compressor: the compressor (a ``fastcomm.compress`` instance, or your own).
        residual: error feedback kept by the caller (:class:`Residual`); ``None``: none.
        op: ``dist.ReduceOp.AVG`` (default) or ``SUM``.
        group: the process group (``None``: the default one).
        async_op: return a :class:`CompressedWork` instead of waiting.
        seed: drives stochastic rounding; use the same on every rank (a step counter, say).
        shapes: the parameter shapes ``tensor`` holds back to back (PowerSGD's matrices).
        chunk_bytes: payload bytes per piece of a collective (several in flight keep a TCP link busy).
        traffic: where to count what this rank sends (a :class:`~fastcomm.collectives.Traffic`), beside
            what a dense ring all-reduce of ``tensor`` sends, once the exchange has sent it; ``None``: not
            counted.

    Returns:
        ``None``, or a :class:`CompressedWork` with ``async_op=True``.

    Example::

        compressor = fastcomm.compress.QuantCompressor(bits=8)
        residual = fastcomm.collectives.Residual()
        fastcomm.collectives.all_reduce(tensor, compressor, residual=residual)  # tensor: the mean
    """
    flat = _check(tensor, "tensor", op)
    rank, buffers = _rank_in(group), FreshBuffers()
    name = "fastcomm.collectives.all_reduce"
    if residual is not None:
        residual.settle()
    if isinstance(compressor, AllreduceCompressor):
        plan = compressor.plan(list(shapes) if shapes is not None else [tensor.shape], 0)
        fp32 = torch.empty(0, dtype=torch.float32, device=flat.device)
        state = (None, None)
        if compressor.keeps_state:
            kept = residual.take("compressor_state", fp32, flat.numel()) if residual is not None else None
            state = (kept, kept) if kept is not None else (torch.zeros_like(flat, dtype=torch.float32), None)
        x = flat.float()
        if residual is not None:
            x = residual.take("worker", fp32, flat.numel())
            x.add_(flat)  # x, turned into the new residual by the second round's finish
        dense = ring_bytes(flat.numel(), flat.element_size(), dist.get_world_size(group))

        def counted(issued: rounds.Rounds) -> None:
            factors = issued.plan.first_numel + issued.plan.second_numel
            _count(traffic, ring_bytes(factors, 4, dist.get_world_size(group)), dense)

        pending = rounds.start_rounds(
            compressor, plan, x, flat, residual=None if residual is None else x, state=state,
            seed=exchange_seed(seed, 0, 1), group=group, buffers=buffers, name=name, on_issued=counted,
        )  # fmt: skip
        return _finish(pending.future, pending, flat, op, async_op, residual, group)
    if not isinstance(compressor, Compressor):
        raise TypeError(
            f"compressor must provide fastcomm.compress.Compressor or AllreduceCompressor, got "
            f"{type(compressor).__name__}"
        )
    worker = None if residual is None else residual.take("worker", flat, flat.numel())
    world_size = dist.get_world_size(group)
    if compressor.block == 0:
        row = gather.compress_row(compressor, flat, worker, worker, buffers, exchange_seed(seed, rank, 1))
        gathered = gather.gather_row(row, world_size=world_size, group=group, chunk_bytes=chunk_bytes,
                                     buffers=buffers)  # fmt: skip
        _count(traffic, gathered.sent_bytes, ring_bytes(flat.numel(), flat.element_size(), world_size))

        def decode(arrived: torch.futures.Future) -> Tensor:
            collective_value(arrived, f"{name} all-gather", None)
            gather.decode_mean(compressor, gathered.rows, flat, world_size)
            return tensor

        return _finish(_chain(gathered.future, decode), None, flat, op, async_op, residual, group)
    layout = two_phase.TwoPhaseLayout.of_blocks(compressor, flat.numel(), world_size)
    phase1 = two_phase.start_phase1(
        flat, layout, residual_out=worker, residual_in=worker, group=group, chunk_bytes=chunk_bytes,
        seed=exchange_seed(seed, rank, 1), buffers=buffers, name=name,
    )  # fmt: skip
    server = None
    if residual is not None:
        server = residual.take("server", torch.empty(0, device=flat.device), layout.segment)
        residual.place_segment(rank * layout.segment, world_size)
    dense = ring_bytes(flat.numel(), flat.element_size(), world_size)
    pending = _PhaseTwo(phase1, flat, server, rank, group, exchange_seed(seed, rank, 2), traffic, dense)
    future = _chain(phase1.future, lambda done: _then_return(done, tensor))
    return _finish(future, pending, flat, op, async_op, residual, group)


@dataclass
class _PhaseTwo:
    """A two-phase all-reduce whose phase 1 is in flight; :meth:`finish` issues phase 2."""

    phase1: two_phase.Phase1
    out: Tensor
    server: Tensor | None
    rank: int
    group: dist.ProcessGroup | None
    seed: int
    traffic: Traffic | None
    dense_bytes: int

    @property
    def future(self) -> torch.futures.Future[Tensor]:
        return self.phase1.future

    def finish(self, group: dist.ProcessGroup | None = None) -> None:
        mean = torch.empty(self.phase1.layout.segment, dtype=torch.float32, device=self.out.device)
        two_phase.start_phase2(
            self.phase1, self.out, mean, server_out=self.server, server_in=self.server, rank=self.rank,
            group=self.group if group is None else group, seed=self.seed, buffers=FreshBuffers(),
            on_issued=lambda phase2: _count(self.traffic, phase2.sent_bytes, self.dense_bytes),
        )  # fmt: skip


def reduce_scatter(
    output: Tensor,
    input: Tensor,
    compressor: Compressor,
    *,
    residual: Residual | None = None,
    op: dist.ReduceOp = dist.ReduceOp.AVG,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    seed: int = 0,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    traffic: Traffic | None = None,
) -> CompressedWork | None:
    """This rank's shard of the mean (or sum) over ranks of ``input``, through a blockwise ``compressor``.

    ``input`` holds ``W`` equal shards back to back, as for ``dist.reduce_scatter_tensor``. Each rank
    compresses shard ``j`` (zero padded to whole blocks; with error feedback plus its residual) and sends it
    to rank ``j`` (all-to-all, in pieces); rank ``j`` decodes the ``W`` copies in rank order, summed (AVG:
    divided by ``W``), into ``output``. One compressed payload per shard: a rank sends ``(W - 1) / W`` of
    its compressed input.

    Args:
        output: this rank's shard (``input.numel() / W`` elements); overwritten.
        input: the tensor to reduce, the same size on every rank.
        compressor: a blockwise :class:`~fastcomm.compress.Compressor` (``block > 0``).
        residual: error feedback of ``input`` kept by the caller, or ``None``.
        op, group, async_op, seed, chunk_bytes: as for :func:`all_reduce`.
        traffic: as for :func:`all_reduce`; the dense twin is ``dist.reduce_scatter_tensor``'s
            (``(W - 1) / W`` of ``input``).

    Example::

        shard = torch.empty(grad.numel() // dist.get_world_size())
        fastcomm.collectives.reduce_scatter(shard, grad, fastcomm.compress.QuantCompressor(bits=8))
    """
    out, flat = _check(output, "output", op), _check(input, "input")
    world_size, rank = dist.get_world_size(group), _rank_in(group)
    if not isinstance(compressor, Compressor) or compressor.block <= 0:
        raise TypeError(
            f"reduce_scatter needs a blockwise fastcomm.compress.Compressor (block > 0), got "
            f"{type(compressor).__name__}: use all_reduce for top-k or PowerSGD"
        )
    if flat.numel() != world_size * out.numel() or out.dtype != flat.dtype:
        raise ValueError(
            f"input must hold {world_size} shards of output's size and dtype: input {flat.numel()} "
            f"{flat.dtype}, output {out.numel()} {out.dtype}"
        )
    shard = out.numel()
    unit = block_unit(compressor.block)
    layout = two_phase.TwoPhaseLayout(compressor, segment_layout(shard, 1, unit), unit)
    if residual is not None:
        residual.settle()
    worker = None if residual is None else residual.take("worker", flat, flat.numel())
    phase1 = two_phase.start_phase1(
        flat, layout, residual_out=worker, residual_in=worker, group=group, chunk_bytes=chunk_bytes,
        seed=exchange_seed(seed, rank, 1), buffers=FreshBuffers(), name="fastcomm.collectives.reduce_scatter",
        stride=shard,
    )  # fmt: skip
    pieces = list(phase1.pieces)
    sent = (world_size - 1) * layout.compressor.wire_bytes(layout.segment, flat.dtype)
    _count(traffic, sent, (world_size - 1) * shard * flat.element_size())

    def decode(arrived: torch.futures.Future) -> Tensor:
        try:
            for done in arrived.value():
                done.value()
        except Exception as error:
            raise phase1.failure("all-to-all", error) from error
        for piece in pieces:
            if piece.start < shard:
                two_phase.reduce_piece(phase1, piece, out[piece.start : min(piece.stop, shard)],
                                       mean=op == dist.ReduceOp.AVG)  # fmt: skip
        return output

    futures = [piece.work.get_future() for piece in pieces]
    future = _chain(torch.futures.collect_all(futures), decode)
    return _finish(future, None, out, dist.ReduceOp.AVG, async_op, residual, group)  # op applied in decode


def all_gather(
    output: Tensor,
    input: Tensor,
    compressor: Compressor,
    *,
    residual: Residual | None = None,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    seed: int = 0,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    traffic: Traffic | None = None,
) -> CompressedWork | None:
    """Every rank's ``input``, compressed, decoded into ``output`` (``W`` times its size, rank order).

    As ``dist.all_gather_into_tensor`` with each rank's part sent as ``compressor``'s payload (ZeRO++'s
    quantized weight all-gather): row ``i`` of ``output`` is rank ``i``'s decoded input. With a
    ``residual``, what this rank's payload left out is added to its next input (rarely wanted for weights).
    ``traffic``: as for :func:`all_reduce`; the dense twin is ``dist.all_gather_into_tensor``'s.

    Example::

        full = torch.empty(dist.get_world_size() * shard.numel())
        fastcomm.collectives.all_gather(full, shard, fastcomm.compress.QuantCompressor(bits=8))
    """
    out, flat = _check(output, "output"), _check(input, "input")
    world_size, rank = dist.get_world_size(group), _rank_in(group)
    if not isinstance(compressor, Compressor):
        raise TypeError(f"all_gather needs a fastcomm.compress.Compressor, got {type(compressor).__name__}")
    if out.numel() != world_size * flat.numel() or out.dtype != flat.dtype:
        raise ValueError(
            f"output must hold {world_size} inputs of input's size and dtype: output {out.numel()} "
            f"{out.dtype}, input {flat.numel()} {flat.dtype}"
        )
    if residual is not None:
        residual.settle()
    worker = None if residual is None else residual.take("worker", flat, flat.numel())
    buffers = FreshBuffers()
    row = gather.compress_row(compressor, flat, worker, worker, buffers, exchange_seed(seed, rank, 1))
    gathered = gather.gather_row(row, world_size=world_size, group=group, chunk_bytes=chunk_bytes,
                                 buffers=buffers)  # fmt: skip
    _count(traffic, gathered.sent_bytes, (world_size - 1) * flat.numel() * flat.element_size())

    def decode(arrived: torch.futures.Future) -> Tensor:
        collective_value(arrived, "fastcomm.collectives.all_gather", None)
        gather.decode_rows(compressor, gathered.rows, out.view(world_size, -1))
        return output

    return _finish(_chain(gathered.future, decode), None, out, dist.ReduceOp.AVG, async_op, residual, group)
