"""The deterministic global sample order: one permutation per (seed, epoch), split across ranks, resumable.

Every random choice comes from ``numpy.random.default_rng([seed, epoch])``: never from time, pid or the
number of workers, so any process can recompute any rank's order.

1. :func:`epoch_order` gives the global order of one epoch. ``shuffle=True`` (``"full"``) is one uniform
   permutation of every sample, as ``DataLoader(shuffle=True)`` gives; ``False`` is storage order.
   ``shuffle="shard"`` is the explicit mode for sources where random access is costly (streamed shards,
   spinning disks): it keeps reads local by permuting shards, grouping them into windows of ``window``
   shards, permuting the blocks of ``block`` consecutive samples of a window, and permuting samples within
   runs of ``window`` blocks. It trades batch diversity for locality: a batch draws from about
   ``window`` blocks, so on a class-sorted set it holds far fewer classes than a full shuffle.
   ``shuffle="window"`` is what ``shuffle=True`` becomes on a source read shard by shard whose cache holds
   ``window`` shards but not the whole set (:meth:`fastio.pipeline.settings.OrderSettings.within`): a sliding
   window of shards. Shards are permuted; the shard in place ``p`` spreads its samples uniformly at random
   over the stretch ``[p, p + window)`` of the epoch (in units of one shard's turn), and samples are read in
   the order of where they fell, the stretches clamped to ``[window - 1, shards)`` so that the first
   ``window`` shards open together and the last ``window`` close together. So at every point of the epoch
   ``window`` shards are open, each contributing to every batch; one shard opens as another closes, never
   ``2 * window`` at a window's edge. Diversity is bounded by what the cache holds: a batch draws from at most
   ``window + 1`` shards, where a full permutation draws from nearly every shard. ``shuffle="parts"`` is what
   ``shuffle=True`` becomes instead where the source can read parts of shards
   (:meth:`fastio.sources.Source.split_shards`: each shard split into contiguous runs of samples, cached one
   by one): the same sliding window, over the parts, which ``shard_sizes`` then lists. A window of ``window``
   parts drawn from a permutation of every part of every shard holds parts of far more shards than ``window``
   whole shards would: the cache's bytes spread over most shards.
2. :func:`rank_indices` splits what remains of an epoch, ``order[start:]``, across ranks exactly like
   ``torch.utils.data.DistributedSampler``: rank ``r`` takes positions ``r, r + W, r + 2W, ...``; with
   ``drop_last=False`` the tail is padded by repeating the epoch's first samples so every rank has
   ``ceil((N - start) / W)`` samples; with ``drop_last=True`` it is cut to ``floor((N - start) / W)``. Every
   rank therefore has the same number of batches (DDP never waits on a rank that ran out).
3. Resuming: when every rank has consumed ``m`` samples, the positions consumed are exactly the first
   ``W * m`` of ``order[start:]`` (capped at what remains), so :func:`advance` returns the new ``start``.
   The same world size continues with exactly the same batches; another world size splits the remainder,
   losing and repeating nothing (beyond the padding ``DistributedSampler`` also adds).

Example::

    order = epoch_order([13] * 9, seed=0, epoch=3, shuffle=True)   # a full permutation
    mine = rank_indices(order, start=0, world_size=4, rank=1, drop_last=False)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = [
    "SHUFFLE_MODES",
    "advance",
    "epoch_order",
    "normalize_shuffle",
    "num_batches",
    "rank_indices",
    "resume_start",
    "window_within",
]

SHUFFLE_MODES = ("none", "shard", "window", "parts", "full")


def normalize_shuffle(shuffle: bool | str) -> str:
    """``True`` -> ``"full"``, ``False`` -> ``"none"``; strings are checked.

    Example::

        normalize_shuffle(True) == "full"
    """
    if shuffle is True:
        return "full"
    if shuffle is False or shuffle is None:
        return "none"
    if shuffle not in SHUFFLE_MODES:
        raise ValueError(f"shuffle must be True, False or one of {SHUFFLE_MODES}, got {shuffle!r}")
    return shuffle


def epoch_order(
    shard_sizes: Sequence[int],
    seed: int,
    epoch: int,
    shuffle: bool | str = True,
    block: int = 256,
    window: int = 4,
) -> np.ndarray:
    """The global sample order (int64 indices into the concatenated shards) of one epoch.

    Args:
        shard_sizes: samples per shard, in storage order.
        seed, epoch: the only sources of randomness.
        shuffle: ``True``/``"full"``, ``"shard"``, ``"window"``, ``"parts"`` or ``False``/``"none"`` (see the
            module docstring; for ``"parts"``, ``shard_sizes`` are the parts').
        block: samples per block of the shard-aware shuffle.
        window: ``"shard"``: shards per block-shuffle window, and blocks per sample-shuffle run;
            ``"window"``, ``"parts"``: shards (parts) open at once.

    Example::

        a = epoch_order([10, 10], 0, 0); b = epoch_order([10, 10], 0, 0)
        assert (a == b).all()
    """
    mode = normalize_shuffle(shuffle)
    sizes = np.asarray(shard_sizes, dtype=np.int64)
    total = int(sizes.sum())
    if block < 1 or window < 1:
        raise ValueError(f"block and window must be >= 1, got {block}, {window}")
    if mode == "none" or total == 0:
        return np.arange(total, dtype=np.int64)
    rng = np.random.default_rng([int(seed), int(epoch)])
    if mode == "full":
        return rng.permutation(total).astype(np.int64)
    if mode in ("window", "parts"):
        return _sliding_window(sizes, rng, window)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    shard_order = rng.permutation(len(sizes))
    # Blocks of every shard, listed in shuffled shard order, tagged with their window.
    blocks_per_shard = (sizes[shard_order] + block - 1) // block
    block_shard = np.repeat(shard_order, blocks_per_shard)
    block_window = np.repeat(np.arange(len(sizes)) // window, blocks_per_shard)
    first_block = np.concatenate([[0], np.cumsum(blocks_per_shard)[:-1]])
    block_in_shard = np.arange(len(block_shard)) - np.repeat(first_block, blocks_per_shard)
    block_start = starts[block_shard] + block_in_shard * block
    block_len = np.minimum(block, sizes[block_shard] - block_in_shard * block)
    perm = np.lexsort((rng.random(len(block_shard)), block_window))
    block_start, block_len = block_start[perm], block_len[perm]
    # Expand blocks to samples, then permute samples within runs of `window` blocks.
    sample_block = np.repeat(np.arange(len(block_start)), block_len)
    first_sample = np.concatenate([[0], np.cumsum(block_len)[:-1]])
    order = block_start[sample_block] + (np.arange(total) - first_sample[sample_block])
    run = sample_block // window
    return order[np.lexsort((rng.random(total), run))].astype(np.int64)


def _sliding_window(sizes: np.ndarray, rng: np.random.Generator, window: int) -> np.ndarray:
    """``shuffle="window"`` (see the module docstring): the shard in place ``p`` of a shard permutation
    spreads its samples uniformly over ``[p, p + window)`` clamped to ``[window - 1, shards)``; samples are
    read in the order of where they fell."""
    shards = len(sizes)
    window = min(window, shards)
    place = np.empty(shards, dtype=np.float64)
    place[rng.permutation(shards)] = np.arange(shards)
    # Clamped, the first and last shards open (close) together, so window shards are open from the start.
    lo, hi = np.maximum(place, window - 1), np.minimum(place + window, shards)
    when = np.repeat(lo, sizes) + rng.random(int(sizes.sum())) * np.repeat(hi - lo, sizes)
    return np.argsort(when, kind="stable").astype(np.int64)


def window_within(shards_held: int, shard_sizes: Sequence[int], reach: int) -> int:
    """The ``"window"`` that keeps a pass within ``shards_held`` shards: at any point about ``window`` shards
    are open, plus those the reads around it still (or already) hold, ``reach`` samples of the epoch's order
    (the batches in flight on every rank), in shard turns of the mean shard; one more opens as one closes,
    which the cache admits beyond its limit. So ``window + reach / mean shard < shards_held + 1``.

    Example::

        assert window_within(4, [1000] * 16, reach=256) == 4 and window_within(4, [100] * 16, 256) == 2
    """
    sizes = [int(s) for s in shard_sizes if s > 0]
    spread = reach / (sum(sizes) / len(sizes)) if sizes else 0.0
    return max(1, math.ceil(shards_held + 1 - spread) - 1)


def rank_indices(order: np.ndarray, start: int, world_size: int, rank: int, drop_last: bool) -> np.ndarray:
    """This rank's samples of ``order[start:]`` (``DistributedSampler`` split, see the module docstring).

    Example::

        rank_indices(np.arange(10), 0, 4, 3, drop_last=False)   # [3, 7, 1]: padded with position 1
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    total = len(order)
    start = min(max(int(start), 0), total)
    remaining = order[start:]
    if drop_last:
        per_rank = len(remaining) // world_size
        return remaining[rank : per_rank * world_size : world_size]
    per_rank = -(-len(remaining) // world_size)
    padding = per_rank * world_size - len(remaining)
    if padding:
        # Like DistributedSampler: repeat from the epoch's beginning (cycling if the epoch is tiny).
        remaining = np.concatenate([remaining, np.resize(order, padding)])
    return remaining[rank::world_size]


def num_batches(num_samples: int, batch_size: int, drop_last: bool) -> int:
    """Batches of ``batch_size`` from ``num_samples`` samples.

    Example::

        num_batches(10, 4, drop_last=False) == 3
    """
    return num_samples // batch_size if drop_last else -(-num_samples // batch_size)


def advance(start: int, world_size: int, consumed_per_rank: int, total: int) -> int:
    """The epoch position after every rank of ``world_size`` consumed ``consumed_per_rank`` samples.

    Example::

        advance(0, 4, 3, 10) == 10   # 12 positions consumed, 2 of them padding
    """
    return min(int(total), int(start) + int(world_size) * int(consumed_per_rank))


def resume_start(total: int, start: int, world_size: int, batches_yielded: int, batch_size: int) -> int:
    """The epoch position a state dict leaves: every rank of ``world_size`` handed over ``batches_yielded``
    batches of ``batch_size`` from position ``start`` of an epoch of ``total`` positions (a partial last
    batch counts what it held).

    Example::

        resume_start(10, 0, 4, 1, 2) == 8
    """
    start = min(max(int(start), 0), int(total))
    per_rank = -(-(int(total) - start) // int(world_size))  # with DistributedSampler's padding
    consumed = min(int(batches_yielded) * int(batch_size), per_rank)
    return advance(start, world_size, consumed, total)
