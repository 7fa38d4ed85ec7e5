"""Small helpers every hook uses: world size and rank, traffic arithmetic, finiteness, seeds, timers."""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist
from torch import Tensor

from fastcomm.compress.protocol import all_finite

__all__ = [
    "BucketKey",
    "Timer",
    "all_finite",
    "all_gather_flat",
    "block_unit",
    "completed",
    "ring_bytes",
    "seed_for",
    "segment_layout",
    "world_of",
]

# a bucket layout is named by the integer keys of its parameters, in bucket order
BucketKey = tuple[int, ...]

# all_gather_into_tensor was renamed all_gather_single; use whichever this torch has, without a warning.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def world_of(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """``(world_size, rank)`` of ``group`` (the default group when ``None``)."""
    return dist.get_world_size(group), dist.get_rank(group)


def ring_bytes(numel: int, element_size: int, world_size: int) -> int:
    """Bytes one rank sends in a ring allreduce of ``numel`` elements: ``2 (W - 1) / W`` of the tensor.

    Example::

        >>> ring_bytes(1000, 4, 2)
        4000
    """
    return 2 * (world_size - 1) * numel * element_size // world_size


def completed(tensor: Tensor) -> torch.futures.Future[Tensor]:
    """A future that already holds ``tensor``."""
    future: torch.futures.Future[Tensor] = torch.futures.Future()
    future.set_result(tensor)
    return future


def seed_for(base: int, step: int, key: BucketKey, rank: int, phase: int) -> int:
    """A stochastic-rounding seed unique to (seed option, step, bucket, rank, phase), identical on resume."""
    first = key[0] if key else 0
    return ((((base * 1_000_003 + step) * 65_537 + first) * 4_099 + rank) * 4 + phase) % (2**62)


def block_unit(block: int) -> int:
    """The two-phase piece granularity for ``block``-element blocks: ``lcm(block, 8)`` (whole blocks, bytes).

    Example::

        >>> block_unit(100)
        200
    """
    return math.lcm(block, 8)


def segment_layout(numel: int, world_size: int, unit: int) -> int:
    """Length of each rank's segment in two-phase hooks: ``ceil(numel / W)`` rounded up to ``unit``.

    Example::

        >>> segment_layout(1000, 2, 64)
        512
    """
    per_rank = max(1, math.ceil(numel / world_size))
    return math.ceil(per_rank / unit) * unit


class Timer:
    """Accumulates the wall time of the ``with`` blocks it guards (a hook call's compression work).

    Example::

        timer = Timer()
        with timer:
            work()
        print(timer.seconds)
    """

    def __init__(self) -> None:
        self.seconds = 0.0
        self._start = 0.0

    def __enter__(self) -> Timer:
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds += time.perf_counter() - self._start
