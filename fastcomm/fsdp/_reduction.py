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
        self.seed, self.index = seed, index

    def step_seed(self) -> int:
        """The stream of the next call (:func:`~fastcomm.collectives.seeds.group_stream`: base seed, group
        index and step counter, equal on every rank), the ``seed`` the collective is called with."""
        return group_stream(self.seed, self.index, self.traffic.calls)

    def residual_bytes(self) -> int:
        """Bytes of error feedback this rank keeps for this group between steps."""
        return 0 if self.feedback is None else self.feedback.nbytes()

    def state_dict(self) -> dict[str, Any]:
        """Step counter, traffic and residual (``None`` without error feedback)."""
        feedback = None if self.feedback is None else self.feedback.state_dict()
        return {"traffic": self.traffic.state_dict(), "feedback": feedback}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned; ``ValueError`` if error feedback is on in one only."""
        if (state_dict["feedback"] is None) != (self.feedback is None):
            raise ValueError("the saved state and this one differ in error_feedback")
        self.traffic.load_state_dict(state_dict["traffic"])
        if self.feedback is not None:
            self.feedback.load_state_dict(state_dict["feedback"])
