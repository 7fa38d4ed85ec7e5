"""Dtype-cast allreduce hook: reduce the bucket in a narrower float type (bf16 by default), on any backend."""

# No `from __future__ import annotations`: DDP checks a hook's annotations against the real types.
import torch
import torch.distributed as dist
from torch import Tensor

from fastcomm.collectives._layout import Timer
from fastcomm.collectives._threads import then
from fastcomm.collectives.errors import collective_value
from fastcomm.compress.protocol import all_finite
from fastcomm.hooks.engine.defaults import resolve_state
from fastcomm.hooks.engine.options import OptionTypeError
from fastcomm.hooks.engine.state import HookState
from fastcomm.hooks.engine.util import ring_bytes, world_of

__all__ = ["CastState", "cast_hook"]

_CAST_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class CastState(HookState):
    """State of :func:`cast_hook`: the wire dtype, step accounting and statistics.

    Args:
        dtype: the dtype the allreduce runs in: ``torch.bfloat16``, ``torch.float16`` or ``torch.float32``.
        process_group: the group to reduce over; ``None`` for the default group.

    Example::

        state = fastcomm.CastState(dtype=torch.bfloat16)
        ddp.register_comm_hook(state, fastcomm.cast_hook)
    """

    _OPTIONS = ("dtype",)

    def __init__(
        self, dtype: torch.dtype = torch.bfloat16, *, process_group: dist.ProcessGroup | None = None
    ) -> None:
        if not isinstance(dtype, torch.dtype):
            raise OptionTypeError(f"dtype must be a torch.dtype, got {dtype!r} ({type(dtype).__name__})")
        if dtype not in _CAST_DTYPES:
            raise ValueError(f"dtype must be one of {_CAST_DTYPES}, got {dtype!r}")
        self.dtype = dtype
        super().__init__(process_group)


def cast_hook(state: CastState | None, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    """DDP comm hook: mean over ranks computed by an allreduce in ``state.dtype``.

    1. ``wire = (bucket / W).to(dtype)`` in one pass: divided first, so the sum cannot overflow.
    2. One async allreduce of ``wire``.
    3. Cast the result back into the bucket's buffer; record whether it is finite (for step accounting).

    Unlike PyTorch's ``bf16_compress_hook`` this works over gloo as well as NCCL.

    Args:
        state: a :class:`CastState`, or ``None`` for a default (bf16) one per model.
        bucket: the DDP gradient bucket.

    Returns:
        A future holding the averaged bucket in its own dtype.

    Example::

        ddp.register_comm_hook(fastcomm.CastState(torch.bfloat16), fastcomm.cast_hook)
    """
    state = resolve_state(state, bucket, CastState)
    state.begin_bucket(bucket)
    buffer = bucket.buffer()
    world_size, _ = world_of(state.process_group)
    if world_size == 1:
        return state.local(buffer)
    timer = Timer()
    with timer:
        wire = torch.div(buffer, world_size, out=buffer.new_empty(buffer.shape, dtype=state.dtype))
    work = dist.all_reduce(wire, group=state.process_group, async_op=True)
    state.accounting.count(
        ring_bytes(wire.numel(), wire.element_size(), world_size),
        ring_bytes(buffer.numel(), buffer.element_size(), world_size),
        timer.seconds,
        compressed=wire.dtype != buffer.dtype,
    )

    bucket_index = bucket.index()

    def finish(future: torch.futures.Future[list[Tensor]]) -> Tensor:
        result = collective_value(future, "CastState allreduce", bucket_index)[0]
        state.accounting.note_output(all_finite(result))
        return buffer.copy_(result)

    return then(work.get_future(), finish)
