"""The global order: a permutation, repeatable per (seed, epoch), new each epoch, local when asked."""

from __future__ import annotations

import numpy as np
import pytest

from fastio.pipeline.order import advance, epoch_order, num_batches, rank_indices, window_within

SIZES = [13] * 9


@pytest.mark.parametrize("shuffle", [True, "full", "shard", "window", False])
def test_order_is_a_permutation_that_repeats(shuffle):
    a = epoch_order(SIZES, seed=3, epoch=1, shuffle=shuffle)
    assert sorted(a.tolist()) == list(range(117))
    np.testing.assert_array_equal(a, epoch_order(SIZES, seed=3, epoch=1, shuffle=shuffle))
    if shuffle:
        assert not np.array_equal(a, epoch_order(SIZES, seed=3, epoch=2, shuffle=shuffle))
        assert not np.array_equal(a, epoch_order(SIZES, seed=4, epoch=1, shuffle=shuffle))
    else:
        np.testing.assert_array_equal(a, np.arange(117))


def test_shard_aware_shuffle_keeps_reads_local():
    sizes = [100] * 40
    order = epoch_order(sizes, seed=0, epoch=0, shuffle="shard", block=10, window=2)
    shards = order // 100
    # Any run of 20 consecutive samples (2 blocks of 10) touches at most 4 shards (two windows of 2).
    for i in range(0, len(order) - 20, 20):
        assert len(np.unique(shards[i : i + 20])) <= 4
    # Blocks stay together: each sample-shuffle run of 2 blocks holds <= 2 distinct blocks of 10.
    runs = (order // 10).reshape(-1, 20)
    assert max(len(np.unique(r)) for r in runs) <= 2
    full = epoch_order(sizes, seed=0, epoch=0, shuffle="full")
    assert max(len(np.unique((full // 100)[i : i + 20])) for i in range(0, 4000, 20)) > 4


@pytest.mark.parametrize("shuffle", [True, "shard", "window"])
def test_uneven_shards_and_blocks(shuffle):
    sizes = [1, 0, 7, 300, 2]
    order = epoch_order(sizes, seed=1, epoch=0, shuffle=shuffle, block=8, window=2)
    assert sorted(order.tolist()) == list(range(310))


def _open_shards(order: np.ndarray, shard_of: np.ndarray) -> np.ndarray:
    """At each position of ``order``, the shards read both at or before it and at or after it."""
    shards = shard_of[order]
    first = np.full(shards.max() + 1, len(order))
    last = np.full(shards.max() + 1, -1)
    np.minimum.at(first, shards, np.arange(len(order)))
    np.maximum.at(last, shards, np.arange(len(order)))
    delta = np.zeros(len(order) + 1, dtype=np.int64)
    np.add.at(delta, first[first < len(order)], 1)
    np.add.at(delta, last[last >= 0] + 1, -1)
    return np.cumsum(delta)[:-1]


@pytest.mark.parametrize("window", [1, 2, 3, 5])
def test_sliding_window_keeps_window_shards_open(window):
    sizes = [37, 50, 13, 61, 44, 29, 50, 50, 8, 41, 33]
    shard_of = np.repeat(np.arange(len(sizes)), sizes)
    for epoch in range(3):
        order = epoch_order(sizes, seed=5, epoch=epoch, shuffle="window", window=window)
        open_now = _open_shards(order, shard_of)
        assert open_now.max() == window  # never more, and the window is used
    full = _open_shards(epoch_order(sizes, seed=5, epoch=0, shuffle=True), shard_of)
    assert full.max() == len(sizes)


@pytest.mark.parametrize("window", [2, 4, 8])
def test_sliding_window_mixes_every_open_shard_into_each_batch(window):
    # Class-sorted shards (one class per shard, 16 shards of 128): a batch of 64 drawn evenly from `window`
    # shards holds about window * (1 - (1 - 1/window) ** 64) classes; the window must get close to that.
    sizes = [128] * 16
    labels = np.repeat(np.arange(16), 128)
    ours = np.mean([
        _classes_per_batch(epoch_order(sizes, seed=0, epoch=e, shuffle="window", window=window), labels, 64)
        for e in range(4)
    ])  # fmt: skip
    even = window * (1 - (1 - 1 / window) ** 64)
    assert ours >= 0.9 * even, (ours, even)


def test_a_window_of_every_shard_is_no_wider_than_the_set():
    order = epoch_order([13] * 9, seed=2, epoch=0, shuffle="window", window=50)
    np.testing.assert_array_equal(order, epoch_order([13] * 9, seed=2, epoch=0, shuffle="window", window=9))


@pytest.mark.parametrize("shuffle", [True, "window"])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 200])
def test_rank_split_matches_distributed_sampler(world, shuffle):
    import torch

    order = epoch_order(SIZES, seed=0, epoch=0, shuffle=shuffle, window=3)
    ranks = [rank_indices(order, 0, world, r, drop_last=False) for r in range(world)]
    assert len({len(r) for r in ranks}) == 1
    for r in range(world):

        class _Len:
            def __len__(self):
                return 117

        sampler = torch.utils.data.DistributedSampler(_Len(), num_replicas=world, rank=r, shuffle=False)
        np.testing.assert_array_equal(ranks[r], order[list(sampler)])


def test_advance_and_batches():
    assert num_batches(117, 10, False) == 12 and num_batches(117, 10, True) == 11
    assert advance(0, 4, 3, 10) == 10 and advance(5, 2, 1, 117) == 7


def _classes_per_batch(order: np.ndarray, labels: np.ndarray, batch: int) -> float:
    usable = len(order) // batch * batch
    return float(np.mean([len(np.unique(b)) for b in labels[order[:usable]].reshape(-1, batch)]))


def test_full_shuffle_mixes_a_class_sorted_set_like_dataloader():
    import torch

    # 10 classes of 640 samples, stored class by class in shards of 400: the layout that made the old
    # shard-local default give 4.3 classes per batch of 64.
    labels = np.repeat(np.arange(10), 640)
    sizes = [400] * 16
    ours = _classes_per_batch(epoch_order(sizes, seed=0, epoch=0, shuffle=True), labels, 64)
    generator = torch.Generator().manual_seed(0)
    sampler = torch.utils.data.RandomSampler(range(len(labels)), generator=generator)
    theirs = _classes_per_batch(np.array(list(sampler)), labels, 64)
    assert abs(ours - theirs) < 0.2 and ours > 9.5, (ours, theirs)
    local = _classes_per_batch(epoch_order(sizes, seed=0, epoch=0, shuffle="shard"), labels, 64)
    assert local < 8, "the shard-aware mode trades diversity for locality (documented)"


@pytest.mark.parametrize("batch, world, lag", [(8, 1, 0), (8, 1, 3), (4, 2, 2), (1, 3, 4)])
def test_a_window_within_the_cache_keeps_its_working_set_under_the_limit(batch, world, lag):
    # The window chosen for a cache of 3 shards leaves room for what the reads around each batch hold:
    # the working set of every rank (fastio.remote.working_set) fits the limit.
    from fastio.remote.working_set import working_set
    from fastio.sources import ReadPlan

    sizes = [40, 33, 47, 40, 29, 51, 40, 38, 44, 40, 36, 42]
    footprints = np.full(len(sizes), 1000)
    plan = ReadPlan(batch, lag + 1, worker_processes=lag > 0, ranks_share_cache=world > 1)
    window = window_within(3, sizes, plan.reach(world))
    shard_of = np.repeat(np.arange(len(sizes)), sizes)
    for epoch in range(3):
        order = epoch_order(sizes, seed=epoch, epoch=epoch, shuffle="window", window=window)
        for rank in range(world):
            mine = rank_indices(order, 0, world, rank, drop_last=False)
            assert working_set(shard_of[mine], footprints, plan).needed <= 3 * 1000, (window, epoch, rank)
