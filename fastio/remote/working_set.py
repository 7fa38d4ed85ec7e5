"""What a pass keeps pinned in the shard cache at once, so that ``cache_limit`` is checked (and a limit
that works suggested) before the pass starts rather than found short halfway through it.

A shard is pinned from the first batch that reads it until its last sample has been served. While the
consumer waits for batch ``c``:

1. Room is taken in first-read order only: the prefetcher reserves shard after shard, and a fetch waits for
   the prefetcher to reach its batch's shards before it pins any (a shard already cached included). So a
   shard ``c`` needs never waits behind one read later: the batches fetched ahead of ``c``
   (``num_workers + prefetch``), the downloads in flight
   (``download_threads``) and the prefetch (``ahead``) hold room only when there was room to spare.
2. What is cached and pinned then is every shard first read at or before ``c`` and not yet read to the
   end, plus, with worker processes, the shards of a worker's last batch: a worker lets go of them when it
   fetches again, which can be ``batches_in_flight - 1`` batches after they were read to the end.
3. Ranks sharing the node's cache read the same shards in step (the order is split by striding), give or
   take a batch either way and a step apart: a few batches each way (:attr:`ReadPlan.lead`,
   :attr:`ReadPlan.lag` of :class:`fastio.sources.ReadPlan`, which says how the loader fetches).

So the pinned set at ``c`` is every shard whose batches ``[first - lead, last + lag]`` cover ``c``. The cache
admits a shard while the others and its sidecar use at most ``cache_limit`` bytes (it may exceed the limit
by that one shard's file), hence the limit that never stalls: the most, over ``c`` and a shard ``s`` pinned
at ``c``, of the bytes pinned at ``c`` less ``s``'s file, plus the bytes no eviction frees.

Example::

    plan = ReadPlan(batch_size=8, batches_in_flight=4, worker_processes=True)
    needed = working_set(shard_of_each_sample, footprints, plan).needed
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from fastio.remote.room import CacheFullError
from fastio.sources.base import ReadPlan

__all__ = ["WorkingSet", "check_batch", "check_pass", "shards_held", "working_set"]


@dataclasses.dataclass(frozen=True)
class WorkingSet:
    """The pass's pinned bytes at their worst: ``needed`` is the smallest ``cache_limit`` that never waits on
    the pass's own pins; ``peak_bytes`` the bytes of the ``peak_shards`` shards pinned at once around batch
    ``peak_batch``."""

    needed: int
    peak_bytes: int
    peak_shards: int
    peak_batch: int


def working_set(
    shard_of: np.ndarray, footprints: np.ndarray, plan: ReadPlan, resident: int = 0,
    beyond: np.ndarray | None = None,
) -> WorkingSet:  # fmt: skip
    """The pinned bytes of a pass (see the module docstring).

    Args:
        shard_of: the shard of each sample, in the order the pass reads them.
        footprints: bytes of each shard in the cache (its file and what is evicted with it).
        plan: how the pass fetches.
        resident: bytes in the cache that no eviction frees.
        beyond: bytes of each shard the cache admits beyond its limit (its file, not its sidecar);
            default: its whole footprint.

    Returns:
        A :class:`WorkingSet`.

    Example::

        ws = working_set(np.array([0, 0, 1, 1]), np.array([10, 10]), ReadPlan(batch_size=2))
        assert ws.needed == 0   # one shard pinned at a time: each fits with the cache's one-shard slack
    """
    shard_of = np.asarray(shard_of, dtype=np.int64)
    if len(shard_of) == 0:
        return WorkingSet(resident, 0, 0, 0)
    n_batches = (len(shard_of) - 1) // plan.batch_size + 1
    batch = np.arange(len(shard_of), dtype=np.int64) // plan.batch_size
    present = np.flatnonzero(np.bincount(shard_of, minlength=len(footprints)))
    first = np.full(len(footprints), n_batches, dtype=np.int64)
    last = np.full(len(footprints), -1, dtype=np.int64)
    np.minimum.at(first, shard_of, batch)
    np.maximum.at(last, shard_of, batch)
    start = np.maximum(first[present] - plan.lead, 0)
    stop = np.minimum(last[present] + plan.lag, n_batches - 1) + 1  # exclusive
    sizes = np.asarray(footprints, dtype=np.int64)[present]
    slack = sizes if beyond is None else np.asarray(beyond, dtype=np.int64)[present]
    # Pinned bytes per segment between consecutive interval ends (constant within one).
    points = np.unique(np.concatenate([start, stop]))
    lo, hi = np.searchsorted(points, start), np.searchsorted(points, stop)
    delta = np.zeros(len(points), dtype=np.int64)
    np.add.at(delta, lo, sizes)
    np.add.at(delta, hi, -sizes)
    pinned = np.cumsum(delta)[:-1]
    count = np.cumsum(np.bincount(lo, minlength=len(points)) - np.bincount(hi, minlength=len(points)))[:-1]
    needed = int((_range_max(pinned, lo, hi) - slack).max()) + resident
    worst = int(pinned.argmax())
    return WorkingSet(needed, int(pinned[worst]), int(count[worst]), int(points[worst]))


def _range_max(values: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """``values[lo[i]:hi[i]].max()`` for every i (each range non-empty), by a sparse table of maxima."""
    table = [values]
    while 2 ** len(table) <= len(values):
        prev, half = table[-1], 2 ** (len(table) - 1)
        table.append(np.maximum(prev[:-half], prev[half:]))
    level = np.floor(np.log2(hi - lo)).astype(np.int64)
    out = np.empty(len(lo), dtype=values.dtype)
    for k in np.unique(level).tolist():
        pick = level == k
        out[pick] = np.maximum(table[k][lo[pick]], table[k][hi[pick] - 2**k])
    return out


def check_pass(
    cache_dir: str | os.PathLike[str], limit: int | None, shard_of: np.ndarray, footprints: np.ndarray,
    plan: ReadPlan, resident: int = 0, beyond: np.ndarray | None = None,
) -> None:  # fmt: skip
    """Raise :class:`CacheFullError` naming the limit that works when ``limit`` is under
    :func:`working_set`'s ``needed`` (None: no limit, nothing to check).

    Example::

        check_pass("/cache", 10**9, shard_of, footprints, ReadPlan(batch_size=256, batches_in_flight=4))
    """
    if limit is None:
        return
    pinned = working_set(shard_of, footprints, plan, resident, beyond)
    if pinned.needed > limit:
        raise CacheFullError(
            str(cache_dir), limit, 0, pinned.peak_bytes,
            f"cannot hold the shards this rank's read order keeps open at once: {pinned.peak_shards} shards "
            f"({pinned.peak_bytes} bytes) around batch {pinned.peak_batch}: the shard-aware orders mix "
            "`window` shards (shuffle='shard', shuffle=True's window) and a shard stays cached from its "
            "first batch to its last (and, with worker "
            f"processes, up to {plan.batches_in_flight - 1} batches more: a worker lets go of its last "
            f"batch's shards when it fetches again); raise cache_limit to at least {pinned.needed} bytes "
            "(prefetching uses room beyond that when there is some)", pinned.needed,
        )  # fmt: skip


def check_batch(cache_dir: str | os.PathLike[str], limit: int, footprints: list[int]) -> None:
    """Raise :class:`CacheFullError` when the shards one batch reads (their ``footprints``) cannot all be
    in the cache at once: the last one in needs the others under ``limit``.

    Example::

        check_batch("/cache", 100, [60, 60, 60])   # raises: 120 bytes must fit beside the last one
    """
    total, smallest = sum(footprints), min(footprints)
    if total - smallest > limit:
        raise CacheFullError(
            str(cache_dir), limit, 0, total,
            f"cannot hold the {len(footprints)} shards ({total} bytes) that one batch reads together "
            "(the shard-aware orders mix up to `window` shards per batch): raise cache_limit to at least "
            f"{total - smallest} bytes", total - smallest,
        )  # fmt: skip


def shards_held(footprints: list[int], limit: int | None, resident: int = 0) -> int | None:
    """How many shards a cache of ``limit`` bytes holds at once beside ``resident`` bytes: None when every
    shard fits (or there is no limit), else how many of the largest fit (at least 1: the cache admits one
    shard beyond its limit). What ``StreamLoader(shuffle=True)`` sizes its window to
    (:mod:`fastio.pipeline.order`).

    Example::

        assert shards_held([10] * 16, 45) == 4 and shards_held([10] * 16, 160) is None
    """
    room = None if limit is None else limit - resident
    if room is None or sum(footprints) <= room:
        return None
    return max(1, room // max(footprints))
