"""Small helpers every hook uses: bucket keys, world size and rank, a bucket's seed."""

from __future__ import annotations

import torch.distributed as dist

from fastcomm.collectives.seeds import bucket_stream, exchange_seed

__all__ = ["BucketKey", "seed_for", "world_of"]

# a bucket layout is named by the integer keys of its parameters, in bucket order
BucketKey = tuple[int, ...]


def world_of(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """``(world_size, rank)`` of ``group`` (the default group when ``None``)."""
    return dist.get_world_size(group), dist.get_rank(group)


def seed_for(base: int, step: int, key: BucketKey, rank: int, phase: int) -> int:
    """The exchange seed of a bucket: :func:`~fastcomm.collectives.seeds.exchange_seed` of its
    :func:`~fastcomm.collectives.seeds.bucket_stream` (seed option, step, first parameter), identical on
    resume.

    Example::

        >>> seed_for(0, 3, (7, 8), 1, 2)
        3223748734
    """
    return exchange_seed(bucket_stream(base, step, key[0] if key else 0), rank, phase)
