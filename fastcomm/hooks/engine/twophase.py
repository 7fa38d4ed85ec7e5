"""The DDP side of the two-phase compressed allreduce: bucket residuals, seeds, accounting and scheduling.

The exchange itself (phase 1: compressed all-to-all of segments; phase 2: average, re-compress,
all-gather, in pieces) is :mod:`fastcomm.collectives.two_phase`. This module gives it a bucket's staged
residuals (:class:`~fastcomm.hooks.engine.store.BucketStore`), its per-bucket buffers and seeds, counts its
traffic, and decides where phase 2 is issued.

Collective order is fixed on every rank. Phase 1 of each bucket is issued by its hook call, on the state's
process group, like every other collective there (DDP's own, a SyncBatchNorm's, dense buckets). Phase 2:

- ``overlap_phase2=True`` (CPU buckets): on the group's lane (:func:`fastcomm.collectives.lane_for`).
- ``overlap_phase2=False`` (and GPU buckets): the hook call of bucket ``i`` issues phase 1 of bucket ``i``,
  then finishes bucket ``i - 1``; the last bucket also finishes itself. Every rank issues ``p1(0), p1(1),
  p2(0), p1(2), p2(1), ..., p1(last), p2(last - 1), p2(last)``, all from hook calls.

Never from a collective's callback, whose order could differ between ranks (the bug that breaks PyTorch's
PowerSGD over gloo). Each arriving phase-2 piece is decoded straight into the bucket's buffer by its
callback; the bucket's future completes when every piece is decoded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from fastcomm.collectives import PeerCollectiveError, SecondCollective, finish_on_lane, lane_for, then
from fastcomm.collectives import two_phase as exchange
from fastcomm.collectives.two_phase import Phase1, TwoPhaseLayout
from fastcomm.hooks.engine.compression import BucketCall, CompressionState
from fastcomm.hooks.engine.options import require_bool
from fastcomm.hooks.engine.util import BucketKey, seed_for

__all__ = [
    "TwoPhaseBucket",
    "TwoPhaseState",
    "finish_phase2",
    "schedule_second_phase",
    "start_phase1",
    "two_phase_allreduce",
    "two_phase_bucket",
]


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
        # bucket key -> its last phase 2's gathered payloads, kept by the inner state of a hierarchy (made
        # with parts), whose in-node gather sends them instead of the decoded bucket
        kept = options.get("parts") is not None
        self.payloads: dict[BucketKey, exchange.Phase2Payload] | None = {} if kept else None
        super().__init__(**options)

    def layout(self, numel: int, world_size: int) -> TwoPhaseLayout:
        """The compressor and segment for a bucket of ``numel`` elements over ``world_size`` ranks."""
        raise NotImplementedError(f"{type(self).__name__} must say how its buckets are laid out")


@dataclass
class TwoPhaseBucket:
    """A bucket whose phase 1 is in flight (:func:`start_phase1`); :meth:`finish` runs phase 2."""

    call: BucketCall
    phase1: Phase1
    step: int

    @property
    def future(self) -> torch.futures.Future[Tensor]:
        """Completes with the averaged bucket once phase 2 is decoded (or fails with the error)."""
        return self.phase1.future

    def finish(self, group: dist.ProcessGroup | None = None) -> None:
        """:func:`finish_phase2` of this bucket (over ``group``, by default the state's)."""
        finish_phase2(self, group)


def start_phase1(call: BucketCall, layout: TwoPhaseLayout) -> TwoPhaseBucket:
    """Stage the bucket's phase-1 residual and start the exchange's phase 1; returns at once."""
    state, key, entry, flat = call.state, call.key, call.entry, call.flat
    store, step = state.store, state.accounting.steps
    residual_out = residual_in = None
    if state.error_feedback:
        residual_in = store.current(entry, "residual", flat)
        residual_out = store.spare(key, "residual", residual_in)
    phase1 = exchange.start_phase1(
        flat,
        layout,
        residual_out=residual_out,
        residual_in=residual_in,
        group=state.process_group,
        chunk_bytes=state.wire_chunk_bytes,
        seed=seed_for(layout.seed, step, key, call.rank, 1),
        buffers=store.buffers.keyed(key),
        name=type(state).__name__,
        bucket=call.bucket_index,
    )
    if residual_out is not None:
        store.stage(key, "residual", residual_out)
    return TwoPhaseBucket(call, phase1, step)


def finish_phase2(bucket: TwoPhaseBucket, group: dist.ProcessGroup | None = None) -> None:
    """Phase 2 of ``bucket`` with its segment's staged server residual; count its traffic.

    Phase 2 goes over ``group``, by default the state's process group. The bucket's future completes once
    every gathered piece is decoded into the bucket (or fails with the collective's error).
    """
    call, phase1 = bucket.call, bucket.phase1
    state, key, entry, flat = call.state, call.key, call.entry, call.flat
    world_size, rank, store = call.world_size, call.rank, call.state.store
    segment = phase1.layout.segment
    with phase1.timer:
        fp32 = torch.empty(0, dtype=torch.float32, device=flat.device)
        mean = store.buffers.tensor(key, "mean", fp32, segment)
        store.set_segment(entry, rank * segment, world_size)
        server_in = server_out = None
        if state.error_feedback:
            server_in = store.current(entry, "server_residual", mean, segment)
            server_out = store.spare(key, "server_residual", server_in)

    def issued(phase2: exchange.Phase2) -> None:
        if server_out is not None:
            store.stage(key, "server_residual", server_out)
        if isinstance(state, TwoPhaseState) and state.payloads is not None:
            # kept before the bucket's future can complete: whoever waits on it finds this step's
            state.payloads[key] = phase2.payload
        dense = 2 * (world_size - 1) * flat.numel() * flat.element_size() // world_size
        state.accounting.count(phase2.sent_bytes, dense, phase1.timer.seconds, True)

    def decoded(finite: bool, seconds: float) -> None:
        state.accounting.note_output(finite)
        state.accounting.add_seconds(seconds)

    exchange.start_phase2(
        phase1,
        flat,
        mean,
        server_out=server_out,
        server_in=server_in,
        rank=rank,
        group=state.process_group if group is None else group,
        seed=seed_for(phase1.layout.seed, bucket.step, key, rank, 2),
        buffers=store.buffers.keyed(key),
        on_issued=issued,
        on_decoded=decoded,
    )


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


def schedule_second_phase(
    call: BucketCall, start: Callable[[], SecondCollective]
) -> torch.futures.Future[Tensor]:
    """Issue a bucket's first collective (``start()``, now) and schedule its second; return DDP's future.

    Steps 3-4 of :func:`two_phase_allreduce`, for any exchange of two dependent collectives: the bucket
    deferred by the previous hook call is finished after ``start()``, then this one's ``finish`` goes to the
    lane (``overlap_phase2`` and a CPU bucket), or runs now (the last bucket), or is deferred to the next
    hook call. Never from a collective's callback, so every rank issues the same collectives in the same
    order on each group.
    """
    state = call.state
    assert isinstance(state, TwoPhaseState)
    lane = None
    if state.overlap_phase2 and call.flat.device.type == "cpu":
        try:
            lane = lane_for(state.process_group)
        except PeerCollectiveError as error:  # the lane's barrier, at the first compressed bucket
            raise PeerCollectiveError(f"{type(state).__name__} {error.where}", call.bucket_index,
                                      error.reason) from error  # fmt: skip
    mine = start()
    state.flush_pending()
    if lane is not None:
        lane_group = lane.group
        lane.submit(lambda: finish_on_lane(mine, lane_group))
    elif call.last:
        mine.finish()
    else:
        state.defer(mine)
    # DDP reads a future's value as the tensor; a value() in a callback turns the exception set on
    # mine.future into a real error of the returned future, which DDP's backward raises
    return then(mine.future, _result)


def _result(future: torch.futures.Future[Tensor]) -> Tensor:
    return future.value()


def two_phase_bucket(call: BucketCall) -> torch.futures.Future[Tensor]:
    """Compress one bucket of a :class:`TwoPhaseState` hook, in the layout the state gives it."""
    state = call.state
    assert isinstance(state, TwoPhaseState)
    return two_phase_allreduce(call, state.layout(call.flat.numel(), call.world_size))
