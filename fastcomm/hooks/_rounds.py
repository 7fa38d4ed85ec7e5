"""The two-allreduce exchange of an :class:`~fastcomm.compress.AllreduceCompressor` (PowerSGD's).

Per bucket, with ``x`` = gradient + residual (fp32):

1. :func:`start_rounds`, in the hook call: the compressor writes the first vector (PowerSGD: the dense
   elements and every ``P = M Q``); one async allreduce (sum) on the state's process group.
2. :meth:`Rounds.finish`, where :func:`~fastcomm.hooks._twophase.schedule_second_phase` puts it (the
   phase-2 lane, the next hook call, or now for the last bucket), exactly as the two-phase hooks' phase 2:
   wait for the first sum, let the compressor write the second vector (orthogonalize, ``Q = M^T P``), one
   async allreduce (sum) over the lane's group or the state's. Never from a collective's callback.
3. The second sum's callback checks both sums for inf/NaN, and the compressor writes the mean into the
   bucket, the new residual and its next state (staged in the bucket store at step 1).

The sizes of both vectors follow from the bucket's parameter shapes alone (the compressor's plan), so
every rank issues the same collectives, of the same sizes, in the same order, for any bucket layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from fastcomm.compress.protocol import AllreduceCompressor
from fastcomm.hooks._compression import BucketCall
from fastcomm.hooks._errors import PeerCollectiveError, collective_value
from fastcomm.hooks._threads import then, when_done
from fastcomm.hooks._twophase import schedule_second_phase
from fastcomm.hooks._util import Timer, all_finite, completed, ring_bytes, seed_for

__all__ = ["Rounds", "allreduce_rounds", "allreduce_rounds_bucket", "start_rounds"]

# the bucket-layout tensor an AllreduceCompressor keeps across steps (PowerSGD's warm-start Q's)
STATE_TENSOR = "compressor_state"


@dataclass
class Rounds:
    """A bucket whose first allreduce is in flight (:func:`start_rounds`); :meth:`finish` runs the second."""

    call: BucketCall
    compressor: AllreduceCompressor
    plan: Any
    x: Tensor
    residual: Tensor | None
    state_out: Tensor | None
    first: Tensor
    work: dist.Work
    timer: Timer
    future: torch.futures.Future[Tensor] = field(default_factory=torch.futures.Future)

    def finish(self, group: dist.ProcessGroup | None = None) -> None:
        """Wait for the first sum, write the second vector and issue its allreduce over ``group``."""
        call, compressor, plan, timer = self.call, self.compressor, self.plan, self.timer
        state, flat, world_size = call.state, call.flat, call.world_size
        group = state.process_group if group is None else group
        where = f"{type(state).__name__} {{}} allreduce"
        try:
            self.work.wait()
        except Exception as error:
            raise PeerCollectiveError(where.format("first"), call.bucket_index, error) from error
        with timer:
            fp32 = torch.empty(0, dtype=torch.float32, device=flat.device)
            second = state.store.buffers.tensor(call.key, "second", fp32, plan.second_numel)
            if plan.second_numel:
                compressor.second_round(plan, second, self.first, self.x)
        if plan.second_numel:
            try:
                arrived = dist.all_reduce(second, group=group, async_op=True).get_future()
            except Exception as error:  # a group already broken raises at once
                raise PeerCollectiveError(where.format("second"), call.bucket_index, error) from error
        else:
            arrived = completed(second)
        sent = ring_bytes(plan.first_numel + plan.second_numel, 4, world_size)
        dense = ring_bytes(flat.numel(), flat.element_size(), world_size)
        state.accounting.count(sent, dense, timer.seconds, compressed=True)
        first = self.first

        def decode(done: torch.futures.Future) -> Tensor:
            collective_value(done, where.format("second"), call.bucket_index)
            decode_timer = Timer()
            with decode_timer:
                state.accounting.note_output(all_finite(first) and all_finite(second))
                compressor.finish(plan, flat, self.residual, self.state_out, first, second, world_size)
            state.accounting.add_seconds(decode_timer.seconds)
            return flat

        def complete(decoded: torch.futures.Future[Tensor]) -> None:
            try:
                self.future.set_result(decoded.value())
            except Exception as error:  # a failed second allreduce or decode: reaches DDP's wait
                self.future.set_exception(error)

        when_done(then(arrived, decode), complete)


def start_rounds(call: BucketCall, compressor: AllreduceCompressor) -> Rounds:
    """Step 1: ``x``, the staged residual and state, the first vector and its allreduce; returns at once."""
    state, key, entry, flat = call.state, call.key, call.entry, call.flat
    store, numel = state.store, flat.numel()
    timer = Timer()
    with timer:
        plan = compressor.plan([p.shape for p in call.params], state.min_compress_numel)
        fp32 = torch.empty(0, dtype=torch.float32, device=flat.device)
        residual = current = fused = None
        if state.error_feedback:
            current = store.current(entry, "residual", fp32, numel)
            residual = store.spare(key, "residual", current)
            # a compressor with first_round_from forms x = gradient + residual in its own first pass
            if flat.dtype == torch.float32:
                fused = getattr(compressor, "first_round_from", None)
            if fused is None:
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
        first = store.buffers.tensor(key, "first", fp32, plan.first_numel)
        # the same seed on every rank: random starts must agree (PowerSGD's Q)
        seed = seed_for(0, state.accounting.steps, key, 0, 1)
        if fused is not None:
            fused(plan, first, x, flat, current, state_in, seed)
        else:
            compressor.first_round(plan, first, x, state_in, seed)
        try:
            work = dist.all_reduce(first, group=state.process_group, async_op=True)
        except Exception as error:  # a group already broken raises at once
            where = f"{type(state).__name__} first allreduce"
            raise PeerCollectiveError(where, call.bucket_index, error) from error
    return Rounds(call, compressor, plan, x, residual, state_out, first, work, timer)


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
