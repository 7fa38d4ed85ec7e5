"""fastio.pipeline.settings: what StreamLoader groups its keyword arguments into, each checked once with an
error that names the bad value; and fastio.pipeline.batches.EpochOrders, the order each epoch's batches are
cut from."""

from __future__ import annotations

import numpy as np
import pytest

import fastio
from fastio.pipeline.batches import EpochOrders
from fastio.pipeline.settings import AssemblySettings, OrderSettings, WorkerSettings, order_for_source


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: WorkerSettings(num_workers=-1), "num_workers must be >= 0, got -1"),
        (lambda: WorkerSettings(prefetch=0), "prefetch must be >= 1, got 0"),
        (lambda: WorkerSettings(threads=0), "threads must be >= 1, got 0"),
        (lambda: WorkerSettings(mode="auto"), "worker mode must be 'thread' or 'process', got 'auto'"),
        (lambda: AssemblySettings(batch_size=0), "batch_size must be >= 1, got 0"),
        (lambda: OrderSettings(rank=2, world_size=2), "need 0 <= rank < world_size, got rank=2"),
        (lambda: OrderSettings(shuffle="random"), "shuffle must be True, False or one of"),
    ],
    ids=["workers", "prefetch", "threads", "mode", "batch_size", "rank", "shuffle"],
)
def test_a_bad_setting_is_named(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_a_stage_that_is_not_one_is_refused():
    with pytest.raises(TypeError, match="object is not a fastio.assembly.stages.BatchStage"):
        AssemblySettings(stages=[object()])


@pytest.mark.parametrize(
    "workers, mode, slots, processes",
    [(0, "thread", 1, False), (3, "process", 5, True)],
    ids=["main", "processes"],
)
def test_worker_settings_say_what_is_in_flight(workers, mode, slots, processes):
    settings = WorkerSettings(num_workers=workers, prefetch=2, mode=mode)
    assert (settings.slots, settings.processes) == (slots, processes)


def test_the_loader_hands_its_settings_on_whole(shard_dir):
    loader = fastio.StreamLoader(
        shard_dir,
        batch_size=9,
        shuffle=True,
        seed=4,
        num_workers=2,
        order=fastio.OrderOptions(world_size=2, rank=1),
        pin_memory=False,
    )
    assert loader.order == OrderSettings(seed=4, shuffle="full", rank=1, world_size=2)
    assert loader.workers == WorkerSettings(num_workers=2, prefetch=2, mode="thread")
    assert loader.assembly == AssemblySettings(batch_size=9, pin=False)
    assert (loader.batch_size, loader.shuffle, loader.rank, loader.worker_mode) == (9, "full", 1, "thread")


def test_epoch_orders_repeat_for_an_epoch_and_change_for_the_next():
    orders = EpochOrders([13, 7, 9], OrderSettings(seed=5, shuffle=True))
    first = orders(0).copy()
    assert sorted(first.tolist()) == list(range(29))
    assert np.array_equal(orders(1), orders(1)) and not np.array_equal(orders(1), first)
    assert np.array_equal(orders(0), first)


@pytest.mark.parametrize(
    "shuffle, held, reach, mode, window",
    [
        (True, None, 0, "full", 4),  # every shard fits: the local full permutation
        (True, 16, 0, "full", 4),
        (True, 5, 0, "window", 5),  # the window is what the cache holds, whatever shuffle_window said
        (True, 5, 999, "window", 5),  # reads in flight within one shard turn fit the one-shard slack
        (True, 5, 1000, "window", 4),  # ... beyond it they take room from the window
        (True, 5, 2500, "window", 3),
        (True, 5, 3000, "window", 2),
        (True, 5, 10**6, "window", 1),
        (True, 0, 0, "window", 1),
        ("shard", 5, 0, "shard", 4),  # an explicit mode is left alone
        (False, 5, 0, "none", 4),
    ],
)
def test_shuffle_true_is_sized_to_the_shards_a_source_holds(shuffle, held, reach, mode, window):
    order = OrderSettings(seed=1, shuffle=shuffle).within(held, [1000] * 16, reach)
    assert (order.shuffle, order.shuffle_window) == (mode, window)
    assert order.window_shards(16) == {"full": 16, "none": 1}.get(mode, window)


class _WholeShardSource:
    """A source read shard by shard that cannot split its shards (no split_shards): 4 of 16 shards fit."""

    name, shard_sizes, requires_shard_order = "held", [1000] * 16, True

    def shards_held(self) -> int:
        return 4


def test_shuffle_true_on_a_source_without_parts_is_the_window_of_the_shards_it_holds():
    order, split = order_for_source(OrderSettings(shuffle=True), _WholeShardSource(), reach=64, plain=True)
    assert (order.shuffle, order.shuffle_window, split) == ("window", 4, None)
    with pytest.raises(ValueError, match="only a remote source that reads parts"):
        order_for_source(OrderSettings(shuffle="parts"), _WholeShardSource(), 64, True, parts=4)
