"""Reading parts of shards instead of whole ones, so that ``shuffle=True`` under a small ``cache_limit`` mixes
most shards into every batch: how many parts (:func:`choose_parts`), and which samples each holds
(:func:`part_bounds`). This module knows no format: a format's remote source lists the byte ranges of a
part (its :class:`fastio.remote.shard.Shard` with ``ranges``), the cache stores a part like a shard.

Why: a cache of ``k`` whole shards lets a batch mix at most ``k + 1`` shards (one opens as one closes). Cut
every shard into ``P`` parts, and the same bytes hold about ``k * P`` parts, which a seeded permutation of
every part of every shard draws from most shards (:mod:`fastio.pipeline.order`'s ``"parts"``).

How many parts:

1. For ``P = 2, 3, ...`` (at most :data:`MAX_PARTS`, and no more than the largest shard has samples), the
   format lists the parts; the cache holds ``held`` of the largest (:func:`fastio.remote.working_set.
   shards_held`), and the order keeps ``window`` open, less what the reads around a batch hold
   (:func:`fastio.pipeline.order.window_within`).
2. The smallest ``P`` whose window is expected to draw from at least :data:`COVER` of the shards (a window
   of ``W`` parts of a permutation of ``U``: a shard of ``p`` parts is missing from it with probability
   ``C(U - p, W) / C(U, W)``) is taken, found by bisection (more parts hold more of them: the share grows
   with ``P``), so a set of many shards lists its parts a few times, not once per ``P``. Failing that (a
   cache too small for the set, or batches in flight that take most of the room of small parts), the best
   of a few ``P`` from 2 up. More parts than needed would only add requests and cache entries.

Example::

    split, units = choose_parts(files, limit=4 * shard_bytes, resident=0, reach=64, units_for=source.parts)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from fastio.pipeline.order import window_within
from fastio.remote.shard import Shard
from fastio.remote.working_set import shards_held
from fastio.sources.base import ShardParts

__all__ = ["COVER", "MAX_PARTS", "choose_parts", "expected_shards", "part_bounds", "part_key", "parts_of"]

MAX_PARTS = 64  # parts per shard at most: each is a request and a cache entry (with two lock files)
COVER = 0.9  # the share of the shards a window of parts should draw from
_GRID = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48)  # tried when no P covers enough


def part_bounds(num_samples: int, parts: int) -> list[tuple[int, int]]:
    """The ``[first, stop)`` samples of each non-empty part of a shard of ``num_samples`` samples cut into
    ``parts``: ``first = num_samples * j // parts`` (sizes differ by at most one; a shard of fewer samples
    than ``parts`` has one-sample parts, fewer of them).

    Example::

        assert part_bounds(10, 4) == [(0, 2), (2, 5), (5, 7), (7, 10)]
    """
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    cuts = [num_samples * j // parts for j in range(parts + 1)]
    return [(a, b) for a, b in zip(cuts, cuts[1:], strict=False) if b > a]


def part_key(shard: Shard, first: int, stop: int) -> str:
    """The cache key of samples ``[first, stop)`` of ``shard``: its own, with the range (parts of another
    split never share an entry's name).

    Example::

        part_key(shard, 0, 64)   # "3f0c.../shard-000000.bin@0-64"
    """
    return f"{shard.key}@{first}-{stop}"


def parts_of(
    files: Sequence[Shard], chosen: tuple[ShardParts, list[Shard]]
) -> dict[str, tuple[int, int, int]]:
    """Each part's cache key -> ``(shard, first, stop)``, for the parts :func:`choose_parts` chose.

    Example::

        where = parts_of(source_files, choose_parts(...))[units[0].key]   # (0, 0, 64)
    """
    split, units = chosen
    bounds = [(s, a, b) for s, f in enumerate(files) for a, b in part_bounds(f.num_samples, split.parts)]
    return {unit.key: where for unit, where in zip(units, bounds, strict=True)}


def expected_shards(window: int, parts_per_shard: Sequence[int]) -> float:
    """Shards a window of ``window`` parts, drawn from a permutation of every part, is expected to hold parts
    of, when shard ``s`` has ``parts_per_shard[s]`` parts.

    Example::

        assert expected_shards(16, [1] * 16) == 16.0
    """
    total = int(sum(parts_per_shard))
    window = min(int(window), total)

    def log_choose(n: int, k: int) -> float:
        return math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)

    missing = 0.0
    for p in parts_per_shard:
        if p and total - p >= window:
            missing += math.exp(log_choose(total - p, window) - log_choose(total, window))
        elif not p:
            missing += 1.0
    return len(parts_per_shard) - missing


def choose_parts(
    files: Sequence[Shard], limit: int | None, resident: int, reach: int,
    units_for: Callable[[int], list[Shard]], parts: int | None = None,
) -> tuple[ShardParts, list[Shard]] | None:  # fmt: skip
    """The split of ``files`` (whole shards) that lets ``shuffle=True`` mix the most shards through a cache
    of ``limit`` bytes (see the module docstring), with its parts (``units_for(P)``: every part of every
    shard, storage order); None where the cache holds every whole shard (the full permutation then).
    ``parts``: this many per shard, whatever the cache (a split named to resume a state dict).

    Example::

        split, units = choose_parts(source.shards, 4 * 10**6, 0, 64, source.parts)
    """
    if parts is None and shards_held([f.footprint for f in files], limit, resident) is None:
        return None
    shards = sum(1 for f in files if f.num_samples > 0)
    most = min(MAX_PARTS, max((f.num_samples for f in files), default=1))
    if parts is None and most < 2:
        return None

    def split(parts: int) -> tuple[float, ShardParts, list[Shard]]:
        units = units_for(parts)
        held = shards_held([u.footprint for u in units], limit, resident)
        window = len(units) if held is None else window_within(held, [u.num_samples for u in units], reach)
        per_shard = [len(part_bounds(f.num_samples, parts)) for f in files if f.num_samples > 0]
        found = ShardParts(parts, window, max(u.num_samples for u in units), shards)
        return expected_shards(window, per_shard), found, units

    if parts is not None:
        if parts < 1:
            raise ValueError(f"parts must be >= 1, got {parts}")
        return split(parts)[1:]
    best = split(most)
    if best[0] < COVER * shards:  # none covers enough: the best of a few, fewer parts when as good
        tried = [split(p) for p in _GRID if p < most] + [best]
        best = max(tried, key=lambda t: t[0])
        return best[1], best[2]
    lo, hi = 2, most  # the smallest P in [lo, hi] that covers enough
    while lo < hi:
        mid = (lo + hi) // 2
        tried = split(mid)
        if tried[0] >= COVER * shards:
            hi, best = mid, tried
        else:
            lo = mid + 1
    return best[1], best[2]
