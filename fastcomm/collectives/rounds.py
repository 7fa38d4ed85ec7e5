"""The two-allreduce exchange of an :class:`~fastcomm.compress.AllreduceCompressor` (PowerSGD's).

With ``x`` the tensor to average (fp32, 1-D; with error feedback already plus its residual):

1. :func:`start_rounds`: the compressor writes the first vector (PowerSGD: the dense elements and every
   ``P = M Q``); one async allreduce (sum).
2. :meth:`Rounds.finish`, called by the caller when it is the turn of this tensor's second collective (a
   DDP hook: the phase-2 lane, the next hook call, or now): wait for the first sum, let the compressor
   write the second vector (orthogonalize, ``Q = M^T P``), one async allreduce (sum). Never from a
   collective's callback.
3. The second sum's callback checks both sums for inf/NaN, and the compressor writes the mean into
   ``out``, the new residual and its next state.

The sizes of both vectors follow from the plan (the tensor's parameter shapes) alone, so every rank
issues the same collectives, of the same sizes, in the same order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from fastcomm.collectives._layout import Buffers, Timer, completed, profiled
from fastcomm.collectives._threads import then, when_done
from fastcomm.collectives.errors import PeerCollectiveError, collective_value
from fastcomm.compress.protocol import AllreduceCompressor, all_finite

__all__ = ["Rounds", "start_rounds"]


@dataclass
class Rounds:
    """A tensor whose first allreduce is in flight (:func:`start_rounds`); :meth:`finish` runs the second.

    ``future`` completes with ``out`` once the second sum is decoded, or fails with
    :class:`PeerCollectiveError`. ``timer`` holds the compression time of both rounds.
    """

    compressor: AllreduceCompressor
    plan: Any
    x: Tensor
    out: Tensor
    residual: Tensor | None
    state_out: Tensor | None
    first: Tensor
    work: dist.Work
    timer: Timer
    buffers: Buffers
    group: dist.ProcessGroup | None
    name: str
    bucket: int | None
    on_issued: Callable[[Rounds], None] | None = None
    on_decoded: Callable[[bool, float], None] | None = None
    future: torch.futures.Future[Tensor] = field(default_factory=torch.futures.Future)

    def finish(self, group: dist.ProcessGroup | None = None) -> None:
        """Wait for the first sum, write the second vector and issue its allreduce over ``group``.

        ``group`` defaults to the first allreduce's.
        """
        compressor, plan, timer, out = self.compressor, self.plan, self.timer, self.out
        group = self.group if group is None else group
        world_size = dist.get_world_size(group)
        where = f"{self.name} {{}} allreduce"
        try:
            self.work.wait()
        except Exception as error:
            raise PeerCollectiveError(where.format("first"), self.bucket, error) from error
        with timer, profiled(self.name, self.bucket, "second round"):
            fp32 = torch.empty(0, dtype=torch.float32, device=out.device)
            second = self.buffers.tensor("second", fp32, plan.second_numel)
            if plan.second_numel:
                compressor.second_round(plan, second, self.first, self.x)
        if plan.second_numel:
            try:
                arrived = dist.all_reduce(second, group=group, async_op=True).get_future()
            except Exception as error:  # a group already broken raises at once
                raise PeerCollectiveError(where.format("second"), self.bucket, error) from error
        else:
            arrived = completed(second)
        if self.on_issued is not None:
            self.on_issued(self)
        first = self.first

        def decode(done: torch.futures.Future) -> Tensor:
            collective_value(done, where.format("second"), self.bucket)
            decode_timer = Timer()
            with decode_timer, profiled(self.name, self.bucket, "decode"):
                finite = all_finite(first) and all_finite(second)
                compressor.finish(plan, out, self.residual, self.state_out, first, second, world_size)
            if self.on_decoded is not None:
                self.on_decoded(finite, decode_timer.seconds)
            return out

        def complete(decoded: torch.futures.Future[Tensor]) -> None:
            try:
                self.future.set_result(decoded.value())
            except Exception as error:  # a failed second allreduce or decode: reaches the waiter
                self.future.set_exception(error)

        when_done(then(arrived, decode), complete)


def start_rounds(
    compressor: AllreduceCompressor,
    plan: Any,
    x: Tensor,
    out: Tensor,
    *,
    residual: Tensor | None,
    state: tuple[Tensor | None, Tensor | None],
    seed: int,
    group: dist.ProcessGroup | None,
    buffers: Buffers,
    name: str,
    bucket: int | None = None,
    fused: tuple[Callable[..., None], Tensor, Tensor | None] | None = None,
    on_issued: Callable[[Rounds], None] | None = None,
    on_decoded: Callable[[bool, float], None] | None = None,
) -> Rounds:
    """Step 1: the first vector of ``x`` and its allreduce; returns at once.

    Args:
        compressor, plan: the compressor and its plan of the tensor's layout.
        x: the tensor to average, fp32 (with error feedback: gradient plus residual; may be ``residual``).
        out: where the mean lands (any float dtype, ``x``'s size).
        residual: receives what this rank still owes (holds ``x`` on entry), or ``None``.
        state: ``(state_in, state_out)`` of a compressor that ``keeps_state``, else ``(None, None)``.
        seed: the same on every rank (random starts must agree).
        group, buffers, name, bucket: the process group, the buffers, how a failure names the exchange.
        fused: ``(first_round_from, gradient, committed residual)`` where the compressor forms ``x``
            itself in its first pass.
        on_issued: called with the :class:`Rounds` once the second allreduce is issued (before ``future``
            can complete: a DDP hook counts the traffic there).
        on_decoded: called with (both sums finite, decode seconds) before ``future`` completes.
    """
    timer = Timer()
    state_in, state_out = state
    with timer, profiled(name, bucket, "first round"):
        fp32 = torch.empty(0, dtype=torch.float32, device=x.device)
        first = buffers.tensor("first", fp32, plan.first_numel)
        if fused is not None:
            first_round_from, gradient, committed = fused
            first_round_from(plan, first, x, gradient, committed, state_in, seed)
        else:
            compressor.first_round(plan, first, x, state_in, seed)
        try:
            work = dist.all_reduce(first, group=group, async_op=True)
        except Exception as error:  # a group already broken raises at once
            raise PeerCollectiveError(f"{name} first allreduce", bucket, error) from error
    return Rounds(
        compressor, plan, x, out, residual, state_out, first, work, timer, buffers, group, name, bucket,
        on_issued, on_decoded,
    )  # fmt: skip
