"""The global order: a permutation, repeatable per (seed, epoch), new each epoch, local when asked."""

from __future__ import annotations

import numpy as np
import pytest

from fastio.order import advance, epoch_order, num_batches, rank_indices

SIZES = [13] * 9


@pytest.mark.parametrize("shuffle", [True, "full", "shard", False])
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


def test_uneven_shards_and_blocks():
    sizes = [1, 0, 7, 300, 2]
    order = epoch_order(sizes, seed=1, epoch=0, shuffle=True, block=8, window=2)
    assert sorted(order.tolist()) == list(range(310))


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 200])
def test_rank_split_matches_distributed_sampler(world):
    import torch

    order = epoch_order(SIZES, seed=0, epoch=0)
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
