"""The mixed epoch of several weighted streams: a deterministic list of global sample ids that the loader's
rank split, batching and resume (:mod:`fastio.pipeline.order`) walk exactly as they walk one source's order.

1. **Counts**: :func:`epoch_counts` gives stream ``i`` ``round(w_i / sum(w) * epoch_size)`` samples per
   epoch, within 1 (largest remainder, so the counts sum to ``epoch_size``; ties go to the lower index). The
   counts are the same every epoch.
2. **Each stream's own order**: stream ``i`` walks passes over its samples; pass ``k`` is
   :func:`fastio.pipeline.order.epoch_order` of its shards seeded by ``(seed, i)`` and epoch ``k``, so a fresh
   permutation per pass (``shuffle`` applies per stream). Epoch ``e`` takes positions
   ``[e * c_i, (e + 1) * c_i)`` of that endless walk: where it stopped, from the epoch number alone.
3. **Interleave**: :func:`smooth_labels` merges the streams by the keys ``(j + 0.5) / c_i`` of their
   ``j``-th sample, so every stretch of the list holds each stream's share: within 1 for two streams,
   within 2 in general. ``mix="batch"`` interleaves blocks of ``batch_size`` instead (one stream per batch).
4. **Layout**: ranks take positions ``r, r + W, ...`` (:func:`fastio.pipeline.order.rank_indices`), so the
   list is laid out for a world size ``W`` and batch size ``B``: rank ``r`` reads a contiguous stretch of the
   interleave, and within each of its batches the samples are grouped by stream (stream 0 first), which lets a
   batch be gathered stream by stream straight into its buffers. The layout is recorded in the state dict: an
   epoch resumed at another world size keeps its list, so nothing is seen twice or skipped.

Example::

    orders = MixedOrders([[40], [10, 10]], [0.7, 0.3], 60, "sample", OrderSettings(seed=0, shuffle=True))
    ids = orders(epoch=0, layout=(1, 8))      # 60 global ids: stream 0 is [0, 40), stream 1 [40, 60)
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np

from fastio.pipeline.order import epoch_order
from fastio.pipeline.settings import OrderSettings

__all__ = ["MixedOrders", "epoch_counts", "laid_out_labels", "smooth_labels", "stream_walk"]

_STREAM_SEED_TAG = 0x5354524D  # "STRM": keeps a stream's seeds apart from the single-source order's


def epoch_counts(weights: Sequence[float], epoch_size: int) -> np.ndarray:
    """Samples per stream in one epoch: largest remainder of ``w_i / sum(w) * epoch_size``.

    Example::

        epoch_counts([0.7, 0.3], 64).tolist() == [45, 19]
    """
    w = np.asarray(weights, dtype=np.float64)
    quota = w / w.sum() * int(epoch_size)
    counts = np.floor(quota).astype(np.int64)
    left = int(epoch_size) - int(counts.sum())
    counts[np.lexsort((np.arange(len(w)), -(quota - counts)))[:left]] += 1
    return counts


def smooth_labels(counts: Sequence[int]) -> np.ndarray:
    """Stream labels (int64), ``counts[i]`` of label ``i``, spread evenly: sample ``j`` of stream ``i`` is
    placed by the key ``(j + 0.5) / counts[i]`` (ties: the lower stream first).

    Example::

        smooth_labels([2, 1]).tolist() == [0, 1, 0]
    """
    counts = np.asarray(counts, dtype=np.int64)
    labels = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    within = np.arange(len(labels)) - np.repeat(starts, counts)
    keys = (within + 0.5) / np.repeat(counts, counts)
    return labels[np.lexsort((labels, keys))]


def _transposed(sequence: np.ndarray, world_size: int) -> tuple[np.ndarray, np.ndarray]:
    """``(rank, t)`` of each element when rank ``r`` reads a contiguous stretch of ``sequence`` whose length
    is its share under the strided split (``len(range(r, n, W))``)."""
    n = len(sequence)
    lengths = np.array([len(range(r, n, world_size)) for r in range(world_size)], dtype=np.int64)
    rank = np.repeat(np.arange(world_size, dtype=np.int64), lengths)
    t = np.arange(n, dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return rank, t


def laid_out_labels(counts: Sequence[int], world_size: int, batch_size: int, mix: str) -> np.ndarray:
    """The stream label of every position of the epoch's list for the layout ``(world_size, batch_size)``
    (see the module docstring, steps 3 and 4).

    With ``mix="batch"``: ``c_i // batch_size`` whole blocks per stream are interleaved smoothly and dealt
    to the ranks in turn (rank ``r``'s ``j``-th batch is block ``j * W + r``); the blocks that do not go round
    evenly and each stream's remainder form the tail, laid out as in ``mix="sample"`` (so each rank's last one
    or two batches may mix streams).

    Example::

        laid_out_labels([3, 1], world_size=2, batch_size=2, mix="sample").tolist() == [0, 0, 0, 1]
    """
    counts = np.asarray(counts, dtype=np.int64)
    world, size = int(world_size), int(batch_size)
    if mix == "batch":
        blocks = smooth_labels(counts // size)
        rounds = len(blocks) // world
        even = np.repeat(blocks[: rounds * world], size)
        even_rank = np.repeat(np.arange(rounds * world, dtype=np.int64) % world, size)
        even_t = np.repeat(np.arange(rounds * world, dtype=np.int64) // world * size, size)
        even_t += np.tile(np.arange(size, dtype=np.int64), rounds * world)
        tail = np.concatenate([np.repeat(blocks[rounds * world :], size), smooth_labels(counts % size)])
        tail_rank, tail_t = _transposed(tail, world)
        labels = np.concatenate([even, tail])
        rank, t = np.concatenate([even_rank, tail_rank]), np.concatenate([even_t, tail_t + rounds * size])
    else:
        labels = smooth_labels(counts)
        rank, t = _transposed(labels, world)
    # Slots in (rank, t) order; within each of a rank's batches the labels are sorted (grouped by stream).
    slots = np.lexsort((t, rank))
    rank, t, labels = rank[slots], t[slots], labels[slots]
    grouped = labels[np.lexsort((t, labels, t // size, rank))]
    out = np.empty(len(labels), dtype=np.int64)
    out[t * world + rank] = grouped
    return out


def stream_walk(
    shard_sizes: Sequence[int],
    stream: int,
    first: int,
    count: int,
    order: OrderSettings,
    passes: dict[int, np.ndarray] | None = None,
) -> np.ndarray:
    """Positions ``[first, first + count)`` of stream ``stream``'s endless walk (local sample ids): pass
    ``k`` covers positions ``[k * n, (k + 1) * n)`` in the order seeded by ``(order.seed, stream)`` and ``k``.
    ``passes``: pass -> order, kept between calls (an epoch often ends inside the pass the next begins with).

    Example::

        stream_walk([5], 0, 3, 4, OrderSettings()).tolist() == [3, 4, 0, 1]   # no shuffle: storage order
    """
    n = int(np.sum(shard_sizes))
    seed = int(np.random.SeedSequence([order.seed, _STREAM_SEED_TAG, stream]).generate_state(1)[0])
    known = {} if passes is None else passes
    parts, position, left = [], int(first), int(count)
    while left > 0:
        walk, offset = divmod(position, n)
        take = min(left, n - offset)
        if walk not in known:
            block, window = order.shuffle_block, order.shuffle_window
            known[walk] = epoch_order(shard_sizes, seed, walk, order.shuffle, block, window)
        parts.append(known[walk][offset : offset + take])
        position, left = position + take, left - take
    if passes is not None:
        for old in [k for k in passes if k < walk]:  # keep only the pass the walk stopped in
            del passes[old]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


class MixedOrders:
    """The epoch's list of global sample ids (stream ``i``'s local id plus the samples of the streams before
    it), for a layout ``(world_size, batch_size)``; the latest one asked is kept. Thread-safe.

    Args:
        stream_shard_sizes: each stream's samples per shard.
        weights: each stream's weight (> 0).
        epoch_size: samples per epoch, all streams together.
        mix: ``"sample"`` or ``"batch"``.
        order: seed and shuffle (applied to each stream's own walk).

    Example::

        orders = MixedOrders([[13], [7]], [1, 1], 20, "sample", OrderSettings(seed=0, shuffle=True))
        assert len(orders(3, (2, 4))) == 20
    """

    def __init__(
        self,
        stream_shard_sizes: Sequence[Sequence[int]],
        weights: Sequence[float],
        epoch_size: int,
        mix: str,
        order: OrderSettings,
    ) -> None:
        self.stream_shard_sizes = [list(map(int, sizes)) for sizes in stream_shard_sizes]
        self.sizes = np.array([sum(sizes) for sizes in self.stream_shard_sizes], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).astype(np.int64)
        self.weights, self.epoch_size, self.mix, self.settings = list(weights), int(epoch_size), mix, order
        self.counts = epoch_counts(self.weights, self.epoch_size)
        self._cache: tuple[tuple[int, tuple[int, int]], np.ndarray] | None = None
        self._positions: dict[tuple[int, int], list[np.ndarray]] = {}  # per layout; the same every epoch
        self._passes: list[dict[int, np.ndarray]] = [{} for _ in self.stream_shard_sizes]
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self.epoch_size

    def __call__(self, epoch: int, layout: tuple[int, int]) -> np.ndarray:
        key = (int(epoch), (int(layout[0]), int(layout[1])))
        with self._lock:
            if self._cache is None or self._cache[0] != key:
                self._cache = (key, self._build(*key))
            return self._cache[1]

    def _build(self, epoch: int, layout: tuple[int, int]) -> np.ndarray:
        positions = self._positions.get(layout)
        if positions is None:
            labels = laid_out_labels(self.counts, layout[0], layout[1], self.mix)
            positions = [np.flatnonzero(labels == i) for i in range(len(self.counts))]
            self._positions = {layout: positions}
        ids = np.empty(self.epoch_size, dtype=np.int64)
        for i, count in enumerate(self.counts.tolist()):
            sizes, passes = self.stream_shard_sizes[i], self._passes[i]
            walk = stream_walk(sizes, i, epoch * count, count, self.settings, passes)
            ids[positions[i]] = self.starts[i] + walk
        return ids
