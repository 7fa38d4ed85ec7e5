"""What every compressed FSDP reduction keeps: its compressor, error feedback, step counter and traffic.

One reduction serves one FSDP parameter group. Its step counter (the calls so far) is the same on every
rank, since every rank reduces every group once per gradient sync, so it seeds stochastic rounding alike
everywhere and, restored from a checkpoint, alike again after a resume.
"""

from __future__ import annotations

from typing import Any

import torch

from fastcomm.collectives.residual import Residual, check_residual_dtype
from fastcomm.collectives.seeds import group_stream
from fastcomm.collectives.traffic import Traffic
from fastcomm.compress.protocol import AllreduceCompressor, Compressor
from fastcomm.fsdp.reshard import FSDPReshardError, GroupLayout

__all__ = ["Reduction"]


class Reduction:
    """The parts shared by :class:`~fastcomm.fsdp.CompressedReduceScatter` and
    :class:`~fastcomm.fsdp.CompressedReplicaAllReduce`.

    Args:
        compressor: a :class:`~fastcomm.compress.Compressor` (not an ``AllreduceCompressor``: an FSDP
            gradient is a flat shard of many parameters, not the matrices PowerSGD factors).
        error_feedback: keep a residual of what compression left out and add it to the next gradient.
        residual_dtype: the dtype the residual is kept in between steps (``None``: the gradient's).
        seed: the base seed of stochastic rounding.
        index: this parameter group's place in the model (mixed into the seed).
        layout: where the group's parameters lie in the flat gradient the residual covers (saved with it,
            so :meth:`fastcomm.fsdp.FSDPCompression.merge_state_dicts` can re-shard it); ``None``: unknown
            (HSDP, whose residual is one shard position's), and not re-sharded.

    Example::

        reduction = CompressedReduceScatter(fastcomm.compress.QuantCompressor(bits=8))
        print(reduction.traffic.calls, reduction.residual_bytes())
    """

    def __init__(
        self,
        compressor: Compressor,
        *,
        error_feedback: bool = True,
        residual_dtype: torch.dtype | None = None,
        seed: int = 0,
        index: int = 0,
        layout: GroupLayout | None = None,
    ) -> None:
        if isinstance(compressor, AllreduceCompressor) or not isinstance(compressor, Compressor):
            raise TypeError(
                f"fastcomm.fsdp needs a fastcomm.compress.Compressor, got {type(compressor).__name__} "
                f"(an FSDP gradient is a flat shard of many parameters: PowerSGD's matrices are not there)"
            )
        if not isinstance(error_feedback, bool):
            raise ValueError(f"error_feedback must be True or False, got {error_feedback!r}")
        check_residual_dtype(residual_dtype, error_feedback)
        self.compressor = compressor
        self.feedback = Residual(residual_dtype) if error_feedback else None
        self.traffic = Traffic()
        self.seed, self.index, self.layout = seed, index, layout

    def step_seed(self) -> int:
        """The stream of the next call (:func:`~fastcomm.collectives.seeds.group_stream`: base seed, group
        index and step counter, equal on every rank), the ``seed`` the collective is called with."""
        return group_stream(self.seed, self.index, self.traffic.calls)

    def residual_bytes(self) -> int:
        """Bytes of error feedback this rank keeps for this group between steps."""
        return 0 if self.feedback is None else self.feedback.nbytes()

    def state_dict(self) -> dict[str, Any]:
        """Step counter, traffic, residual (``None`` without error feedback) and the layout it covers."""
        feedback = None if self.feedback is None else self.feedback.state_dict()
        layout = None if self.layout is None else self.layout.state_dict()
        return {"traffic": self.traffic.state_dict(), "feedback": feedback, "layout": layout}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned.

        Raises:
            ValueError: error feedback is on in one only.
            FSDPReshardError: the state was saved at another world size (re-shard it first).
        """
        if (state_dict["feedback"] is None) != (self.feedback is None):
            raise ValueError("the saved state and this one differ in error_feedback")
        saved = state_dict.get("layout")
        if saved is not None and self.layout is not None and saved["world_size"] != self.layout.world_size:
            raise FSDPReshardError(
                f"this compression state of parameter group {self.index} was saved by {saved['world_size']} "
                f"ranks, this run has {self.layout.world_size}: merge every old rank's state with "
                f"fastcomm.fsdp.FSDPCompression.merge_state_dicts(states, world_size, rank) and load that"
            )
        self.traffic.load_state_dict(state_dict["traffic"])
        if self.feedback is not None:
            self.feedback.load_state_dict(state_dict["feedback"])
