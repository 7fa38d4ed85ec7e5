"""HSDP with only the cross-replica hop compressed: FSDP2's all-reduce hook (``set_all_reduce_hook``).

FSDP2 reduce-scatters the gradient densely over the shard ranks (inside a node) and calls the hook with
the shard; the hook averages it over the replicas (``mesh.get_group("replicate")``) with
:func:`fastcomm.collectives.all_reduce`, error feedback on the shard. The model sits either on the 2-D
``("replicate", "shard")`` mesh, whose dense all-reduce :func:`fastcomm.fsdp.compress` hands to this hook
(:mod:`fastcomm.fsdp._native_hsdp`), or on ``mesh["shard"]`` with the group given: one reduction either way.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from fastcomm.collectives import DEFAULT_CHUNK_BYTES, all_reduce
from fastcomm.compress.protocol import Compressor
from fastcomm.fsdp._reduction import Reduction
from fastcomm.fsdp._wait import wait_named

__all__ = ["CompressedReplicaAllReduce"]


class CompressedReplicaAllReduce(Reduction):
    """The compressed mean over replicas of one FSDP parameter group's reduced shard.

    1. FSDP reduce-scatters (dense, AVG) inside the shard group and calls this hook with the shard.
    2. The hook averages it over ``group`` in place through ``compressor`` (a blockwise one: the two-phase
       all-to-all and all-gather; another: every replica's payload all-gathered), with error feedback.

    Args:
        compressor: a :class:`~fastcomm.compress.Compressor`.
        group: the replicate process group (same shard index, one rank per replica).
        error_feedback, residual_dtype, seed, index: as for :class:`~fastcomm.fsdp._reduction.Reduction`.
        chunk_bytes: payload bytes per piece of a collective.

    Example::

        compressor = fastcomm.compress.QuantCompressor(bits=8)
        hook = CompressedReplicaAllReduce(compressor, mesh.get_group("replicate"))
        fsdp_module.set_all_reduce_hook(hook)  # sharded on mesh["shard"]; compress() for the 2-D mesh
    """

    def __init__(
        self,
        compressor: Compressor,
        group: dist.ProcessGroup,
        *,
        error_feedback: bool = True,
        residual_dtype: torch.dtype | None = None,
        seed: int = 0,
        index: int = 0,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        super().__init__(
            compressor, error_feedback=error_feedback, residual_dtype=residual_dtype, seed=seed, index=index
        )
        self.group, self.chunk_bytes = group, chunk_bytes

    def __call__(self, reduce_output: Tensor) -> None:
        """Average ``reduce_output`` over the replicas, in place."""
        residual = None if self.feedback is None else self.feedback.lend()
        work = all_reduce(
            reduce_output, self.compressor, residual=residual, group=self.group, async_op=True,
            seed=self.step_seed(), chunk_bytes=self.chunk_bytes, traffic=self.traffic,
        )  # fmt: skip
        wait_named(work, f"fastcomm.fsdp cross-replica all-reduce of parameter group {self.index}")
        if self.feedback is not None:
            self.feedback.keep()
