"""What the hierarchical exchange uses of the flat one it wraps, as protocols.

:mod:`fastcomm.hooks.engine.compression` gives every compressing state a
:class:`~fastcomm.hooks.hierarchical.Hierarchy`, and the hierarchy drives an inner flat state of the same
class over the cross-node group. The hierarchy sees that state, its bucket calls, its deferred second
phases and its phase-2 payloads only through these protocols, so it depends on no hook module.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from fastcomm.hooks.engine.accounting import StepAccounting
from fastcomm.hooks.engine.store import BucketEntry, BucketStore
from fastcomm.hooks.engine.util import BucketKey

__all__ = ["FlatCall", "FlatState", "PhasePayload", "SecondPhase"]


class SecondPhase(Protocol):
    """A bucket whose first collective is in flight; :meth:`finish` issues its second (any exchange).

    :func:`~fastcomm.hooks.engine.twophase.schedule_second_phase` decides where ``finish`` runs (the lane, the
    next hook call, or now); ``future`` completes with the bucket's result once the second collective's
    data is decoded.
    """

    future: torch.futures.Future[Tensor]

    def finish(self, group: dist.ProcessGroup | None = None) -> None:
        """Wait for the first collective, then issue the second over ``group`` (default: the state's)."""
        ...


class PhasePayload(Protocol):
    """One bucket's all-gathered phase-2 payloads (:class:`~fastcomm.hooks.engine.twophase.Phase2Payload`)."""

    @property
    def gathered(self) -> Tensor:
        """The phase-2 all-gather buffer (uint8), the same bytes on every rank of the exchange."""
        ...

    def decode_into(self, out: Tensor, gathered: Tensor) -> bool:
        """Decode ``gathered``, payloads laid out as these, into ``out``; whether they are finite."""
        ...


class FlatState(Protocol):
    """A :class:`~fastcomm.hooks.engine.compression.CompressionState` as the hierarchy uses it."""

    node_size: int | None
    process_group: dist.ProcessGroup | None
    error_feedback: bool
    store: BucketStore
    accounting: StepAccounting

    def options(self) -> dict[str, Any]:
        """The constructor options; ``type(state)(**options)`` builds a state like it."""
        ...

    def defer(self, pending: SecondPhase) -> None:
        """Leave ``pending``'s second phase to a later hook call."""
        ...

    def flush_pending(self) -> None:
        """Issue the deferred second phase, if any."""
        ...


class FlatCall(Protocol):
    """A :class:`~fastcomm.hooks.engine.compression.BucketCall` as the hierarchy uses it (a dataclass)."""

    state: FlatState
    key: BucketKey
    entry: BucketEntry
    flat: Tensor
    world_size: int
    rank: int
    bucket_index: int
