"""FSDP2's gradient reduce-scatter through a blockwise compressor (``FSDPModule.set_custom_reduce_scatter``).

FSDP2 hands its custom reduce-scatter the parameter group's flat gradient (``W`` equal shards back to
back, one per rank) and ``op=AVG`` (``SUM`` for fp16 reductions, which FSDP divides before and after).
:func:`fastcomm.collectives.reduce_scatter` does the rest: each rank compresses the shards it sends (plus
its residual), one all-to-all of the codes, and each rank decodes its ``W`` copies in rank order.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from fastcomm.collectives import DEFAULT_CHUNK_BYTES, reduce_scatter
from fastcomm.compress.protocol import Compressor
from fastcomm.fsdp._reduction import Reduction
from fastcomm.fsdp._wait import wait_named
from fastcomm.fsdp.reshard import GroupLayout

__all__ = ["CompressedReduceScatter"]


class CompressedReduceScatter(Reduction):
    """The compressed reduce-scatter of one FSDP parameter group (torch's ``ReduceScatter`` comm).

    1. Widen the residual (if kept narrow) and call :func:`fastcomm.collectives.reduce_scatter` with it,
       seeded by the step counter.
    2. Wait for it; a failed exchange raises :class:`~fastcomm.PeerCollectiveError`.
    3. Keep the residual, count the bytes sent and the dense reduce-scatter's.

    Args:
        compressor: a blockwise :class:`~fastcomm.compress.Compressor` (quantize, sign, cast, your own).
        error_feedback, residual_dtype, seed, index, layout: as for
            :class:`~fastcomm.fsdp._reduction.Reduction`.
        chunk_bytes: payload bytes per all-to-all piece.

    Example::

        comm = CompressedReduceScatter(fastcomm.compress.QuantCompressor(bits=8, stochastic=False))
        fsdp_module.set_custom_reduce_scatter(comm)
    """

    def __init__(
        self,
        compressor: Compressor,
        *,
        error_feedback: bool = True,
        residual_dtype: torch.dtype | None = None,
        seed: int = 0,
        index: int = 0,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        layout: GroupLayout | None = None,
    ) -> None:
        super().__init__(
            compressor, error_feedback=error_feedback, residual_dtype=residual_dtype, seed=seed, index=index,
            layout=layout,
        )  # fmt: skip
        if compressor.block <= 0:
            raise TypeError(
                f"the compressed reduce-scatter needs a blockwise compressor (block > 0), got "
                f"{type(compressor).__name__}: compress only the cross-replica all-reduce (replicate_group=) "
                f"for top-k"
            )
        self.chunk_bytes = chunk_bytes

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> Tensor:
        """A plain buffer (FSDP allocates the reduce-scatter's input and output through its comm)."""
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: Tensor,
        input_tensor: Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp,
        async_op: bool = False,
    ) -> None:
        """Reduce-scatter ``input_tensor`` into ``output_tensor`` (synchronously: FSDP waits for it)."""
        if op not in (dist.ReduceOp.AVG, dist.ReduceOp.SUM):
            raise ValueError(
                f"fastcomm.fsdp reduces with AVG or SUM, FSDP asked for {op!r} (set_gradient_divide_factor "
                f"makes a PREMUL_SUM: leave it unset)"
            )
        if self.layout is not None and self.layout.numel != input_tensor.numel():
            self.layout = None  # parameters without a gradient left out: re-sharding would misplace elements
        residual = None if self.feedback is None else self.feedback.lend()
        work = reduce_scatter(
            output_tensor, input_tensor, self.compressor, residual=residual, op=op, group=group,
            async_op=True, seed=self.step_seed(), chunk_bytes=self.chunk_bytes, traffic=self.traffic,
        )  # fmt: skip
        wait_named(work, f"fastcomm.fsdp reduce-scatter of parameter group {self.index}")
        if self.feedback is not None:
            self.feedback.keep()
