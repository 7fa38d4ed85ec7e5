"""What the hierarchical exchange uses of the flat one it wraps, and what it gives the flat one.

:mod:`fastcomm.hooks.engine.compression` gives every compressing state a
:class:`~fastcomm.hooks.hierarchical.Hierarchy`, and the hierarchy drives an inner flat state of the same
class over the cross-node group, built with :class:`InnerParts` (the shard store, the shard accounting,
where a deferred second phase goes). The hierarchy sees that state and its bucket calls only through
these protocols, so it depends on no hook module.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch.distributed as dist
from torch import Tensor

from fastcomm.collectives import SecondCollective
from fastcomm.hooks.engine.accounting import ShardAccounting, StepAccounting
from fastcomm.hooks.engine.store import BucketEntry, BucketStore
from fastcomm.hooks.engine.util import BucketKey

__all__ = ["FlatCall", "FlatState", "InnerParts"]


@dataclass(frozen=True)
class InnerParts:
    """What a hierarchy hands the flat state it builds (``type(state)(**options, parts=parts)``).

    Attributes:
        store: the shard store: the inner state's residuals live there, per shard layout.
        accounting: counts the inner exchange's traffic into the outer state's step and the node counters.
        defer: where the inner state's deferred second phases go (the groups' phase-2 thread), or
            ``None`` to finish them in the next hook call. An inner two-phase state also keeps each
            bucket's phase-2 payloads (``payloads``) for the in-node gather.
    """

    store: BucketStore
    accounting: ShardAccounting
    defer: Callable[[SecondCollective], None] | None = None


class FlatState(Protocol):
    """A :class:`~fastcomm.hooks.engine.compression.CompressionState` as the hierarchy uses it."""

    node_size: int | None
    process_group: dist.ProcessGroup | None
    error_feedback: bool
    store: BucketStore
    accounting: StepAccounting | ShardAccounting

    def options(self) -> dict[str, Any]:
        """The constructor options; ``type(state)(**options)`` builds a state like it."""
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
