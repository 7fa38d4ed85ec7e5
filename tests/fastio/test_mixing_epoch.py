"""Weighted streams (fastio.Stream, fastio.mixing): what an epoch means, line by line: each stream's share of
the epoch and of each batch, fresh permutations that continue across epochs, and mix="batch"."""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import pytest

import fastio
from fastio.mixing.schedule import epoch_counts, stream_walk
from fastio.pipeline.settings import OrderSettings

sys.path.insert(0, str(Path(__file__).parent))
from _mixing_helpers import BASE, epoch_ids, flat, mixed_loader  # noqa: E402


# -- what an epoch means --
def test_each_stream_walks_fresh_permutations_and_continues_across_epochs():
    # 20 of each per epoch
    loader = mixed_loader([10, 60], [1, 1], mixing=fastio.MixingOptions(epoch_size=40))
    seen = [flat(epoch_ids(loader, e)) for e in range(6)]
    small = [i for epoch in seen for i in epoch if i < BASE]
    large = [i - BASE for epoch in seen for i in epoch if i >= BASE]
    assert len(small) == len(large) == 120
    passes = [small[k : k + 10] for k in range(0, 120, 10)]
    assert all(sorted(p) == list(range(10)) for p in passes)  # upsampled only after all were used
    assert len({tuple(p) for p in passes}) == len(passes)  # a fresh permutation each pass
    assert sorted(large[:60]) == list(range(60))  # the large one: no repeat before it is exhausted...
    assert large[60:] != large[:60] and sorted(large[60:]) == list(range(60))  # ...spanning 3 epochs
    walk = stream_walk([7] * 8 + [4], 1, 20 * 2, 20, OrderSettings(seed=3, shuffle=True))
    assert large[40:60] == walk.tolist()  # epoch 2 continues at position 2 * 20 of stream 1's walk


def test_stream_order_depends_on_seed():
    assert flat(epoch_ids(mixed_loader([10, 60], [1, 1], seed=0), 0)) != flat(
        epoch_ids(mixed_loader([10, 60], [1, 1], seed=1), 0)
    )
    assert flat(epoch_ids(mixed_loader([10, 60], [1, 1], seed=5), 2)) == flat(
        epoch_ids(mixed_loader([10, 60], [1, 1], seed=5), 2)
    )


@pytest.mark.parametrize("weights", [(0.7, 0.3), (3, 2, 1), (1, 1, 5)])
def test_epoch_takes_each_stream_share_within_one(weights):
    sizes = [31, 17, 9][: len(weights)]
    loader = mixed_loader(sizes, weights, mixing=fastio.MixingOptions(epoch_size=101))
    for epoch in range(2):
        counts = collections.Counter(i // BASE for i in flat(epoch_ids(loader, epoch)))
        for i, w in enumerate(weights):
            assert abs(counts[i] - w / sum(weights) * 101) < 1
        assert sum(counts.values()) == 101


def test_epoch_size_defaults_to_the_sum_of_stream_sizes():
    loader = mixed_loader([31, 17], [1, 4])
    assert len(flat(epoch_ids(loader, 0))) == 48 and len(loader) == 6


@pytest.mark.parametrize("world", [1, 2, 3])
def test_each_batch_holds_each_stream_share_within_one(world):
    for rank in range(world):
        loader = mixed_loader(
            [400, 300],
            [0.7, 0.3],
            batch_size=64,
            mixing=fastio.MixingOptions(epoch_size=640 * world),
            order=fastio.OrderOptions(world_size=world, rank=rank),
        )
        for batch in epoch_ids(loader, 1)[:-1]:
            streams = [i // BASE for i in batch]
            assert streams.count(0) in (44, 45) and streams.count(1) in (19, 20)


def test_three_streams_mix_within_one_per_batch():
    loader = mixed_loader(
        [50, 40, 30], [0.5, 0.3, 0.2], batch_size=20, mixing=fastio.MixingOptions(epoch_size=200)
    )
    for batch in epoch_ids(loader, 0):
        streams = [i // BASE for i in batch]
        assert [abs(streams.count(i) - 20 * w) < 1 for i, w in enumerate((0.5, 0.3, 0.2))] == [True] * 3


@pytest.mark.parametrize("world", [1, 2])
def test_mix_batch_gives_one_stream_per_batch_in_proportion(world):
    per_batch = collections.Counter()
    for rank in range(world):
        loader = mixed_loader(
            [90, 40],
            [0.7, 0.3],
            batch_size=8,
            mixing=fastio.MixingOptions(mix="batch"),
            order=fastio.OrderOptions(world_size=world, rank=rank),
        )
        batches = epoch_ids(loader, 0)
        assert all(len({i // BASE for i in batch}) == 1 for batch in batches[:-2])
        per_batch.update(batch[0] // BASE for batch in batches[:-2])
    share = per_batch[0] / sum(per_batch.values())
    assert abs(share - 0.7) < 0.1


def test_epoch_counts_sum_to_the_epoch_size():
    assert epoch_counts([0.7, 0.3], 64).tolist() == [45, 19]
    assert epoch_counts([1, 1, 1], 10).tolist() == [4, 3, 3]
