"""FSDP's error feedback is the store every mode keeps, :class:`fastcomm.collectives.Residual`.

Kept in a narrower ``residual_dtype`` (``torch.bfloat16``: half the memory of fp32) it is widened into a
working copy for a call (:meth:`~fastcomm.collectives.Residual.lend`, or the call's own
:meth:`~fastcomm.collectives.Residual.take`) and narrowed back after it
(:meth:`~fastcomm.collectives.Residual.keep`), so only the narrow tensors stay allocated between steps.
``ErrorFeedback`` is its name here, kept for code that imports it.

Example::

    feedback = ErrorFeedback(torch.bfloat16)
    fastcomm.collectives.reduce_scatter(shard, grad, compressor, residual=feedback.lend())
    feedback.keep()
"""

from __future__ import annotations

from fastcomm.collectives.residual import Residual as ErrorFeedback

__all__ = ["ErrorFeedback"]
