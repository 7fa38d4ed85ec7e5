"""Error feedback of one FSDP reduction: a :class:`~fastcomm.collectives.Residual` kept between steps.

Kept in the exchange's own dtype (the default) the residual is handed to every call as it is. Kept in a
narrower ``dtype`` (``torch.bfloat16``: half the memory of fp32) it is widened into a working copy for the
call and narrowed back after it, so only the narrow tensors stay allocated between steps.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from fastcomm.collectives import Residual

__all__ = ["ErrorFeedback"]

_NAMES = ("worker", "server", "compressor_state")


class ErrorFeedback:
    """One reduction's residual (what compression left out, added to the next call's input).

    Args:
        dtype: the dtype the residual is kept in between calls; ``None``: the exchange's own (no copies).

    Example::

        feedback = ErrorFeedback(torch.bfloat16)
        fastcomm.collectives.reduce_scatter(shard, grad, compressor, residual=feedback.lend())
        feedback.keep()
    """

    def __init__(self, dtype: torch.dtype | None = None) -> None:
        if dtype is not None and not dtype.is_floating_point:
            raise ValueError(f"residual_dtype must be a floating-point dtype or None, got {dtype!r}")
        self.dtype = dtype
        self.residual = Residual()
        self._kept: dict[str, Tensor] = {}
        self._working: dict[str, torch.dtype] = {}

    def lend(self) -> Residual:
        """The :class:`Residual` for the next call (narrow tensors widened to the exchange's dtype)."""
        if self.dtype is not None:
            for name, kept in self._kept.items():
                setattr(self.residual, name, kept.to(self._working[name]))
        return self.residual

    def keep(self) -> None:
        """After a call: let go of the finished exchange (its code buffers), keep the residual in ``dtype``
        and free the working copies (without a ``dtype``, the residual stays as the call left it)."""
        # Until settled, the residual holds the exchange's future and, through it, every code buffer it
        # sent and received: a byte per parameter each way at 8 bits, held between steps for nothing.
        self.residual.settle()
        if self.dtype is None:
            return
        for name in _NAMES:
            working = getattr(self.residual, name)
            if working is not None:
                self._working[name] = working.dtype
                self._kept[name] = working.to(self.dtype)
                setattr(self.residual, name, None)

    def nbytes(self) -> int:
        """Bytes held between calls."""
        if self.dtype is not None:
            return sum(t.numel() * t.element_size() for t in self._kept.values())
        tensors = (getattr(self.residual, name) for name in _NAMES)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def state_dict(self) -> dict[str, Any]:
        """The kept tensors by name, and the dtype each is widened to for a call."""
        if self.dtype is None:
            kept = {k: v for k, v in self.residual.state_dict().items() if v is not None}
            return {"tensors": kept, "working": {k: str(v.dtype) for k, v in kept.items()}}
        return {"tensors": dict(self._kept), "working": {k: str(v) for k, v in self._working.items()}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        tensors: dict[str, Tensor] = state_dict["tensors"]
        working = {k: getattr(torch, v.removeprefix("torch.")) for k, v in state_dict["working"].items()}
        if self.dtype is None:
            self.residual.load_state_dict({name: tensors.get(name) for name in _NAMES})
            return
        self._kept = {k: v.to(self.dtype) for k, v in tensors.items()}
        self._working = working
