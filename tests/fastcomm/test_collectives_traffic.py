"""The one traffic counter (:class:`fastcomm.collectives.Traffic`): counts, names, checkpoints, and the
collectives counting what they send into it."""

from __future__ import annotations

import threading

import pytest
import torch

import fastcomm
from fastcomm.collectives import Traffic, ring_bytes
from fastcomm.compress import PowerSGDCompressor, QuantCompressor, TopKCompressor


def test_stats_report_sent_dense_and_their_ratio():
    traffic = Traffic()
    traffic.add(sent=1_000, dense=4_000)
    traffic.add(sent=500, dense=2_000)
    assert traffic.calls == 2
    assert traffic.stats() == {"sent_bytes": 1_500, "dense_bytes": 6_000, "compression_ratio": 4.0}


def test_nothing_sent_is_a_ratio_of_one():
    assert Traffic().stats()["compression_ratio"] == 1.0


def test_state_dict_round_trips_and_compares_equal():
    traffic = Traffic()
    traffic.add(sent=7, dense=29)
    again = Traffic()
    again.load_state_dict(traffic.state_dict())
    assert again == traffic and again.stats() == traffic.stats()
    again.add(sent=1, dense=1)
    assert again != traffic


def test_a_checkpoint_that_names_it_bytes_sent_loads():
    traffic = Traffic()
    traffic.load_state_dict({"bytes_sent": 12, "dense_bytes": 48})
    assert (traffic.calls, traffic.sent_bytes, traffic.dense_bytes) == (0, 12, 48)


def test_counts_from_many_threads_add_up():
    traffic = Traffic()

    def count() -> None:
        for _ in range(1_000):
            traffic.add(sent=1, dense=3)

    threads = [threading.Thread(target=count) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert (traffic.calls, traffic.sent_bytes, traffic.dense_bytes) == (4_000, 4_000, 12_000)


@pytest.mark.parametrize(
    ("numel", "size", "world", "expected"), [(1000, 4, 2, 4000), (7, 2, 3, 18), (5, 4, 1, 0)]
)
def test_ring_bytes_is_two_w_minus_one_over_w_of_the_tensor(numel, size, world, expected):
    assert ring_bytes(numel, size, world) == expected


@pytest.mark.parametrize(
    "compressor",
    [QuantCompressor(bits=8), TopKCompressor(10), PowerSGDCompressor(rank=1)],
    ids=["two-phase", "all-gather", "powersgd"],
)
def test_a_collective_counts_one_call_into_the_traffic_it_is_given(one_rank, compressor):
    traffic = Traffic()
    tensor = torch.randn(100, generator=torch.Generator().manual_seed(11))
    extra = {"shapes": [torch.Size([10, 10])]} if isinstance(compressor, PowerSGDCompressor) else {}
    fastcomm.collectives.all_reduce(tensor, compressor, traffic=traffic, **extra)
    assert traffic.calls == 1 and traffic.sent_bytes == traffic.dense_bytes == 0  # one rank sends nothing


def test_reduce_scatter_and_all_gather_count_too(one_rank):
    traffic = Traffic()
    x = torch.randn(64, generator=torch.Generator().manual_seed(12))
    fastcomm.collectives.reduce_scatter(torch.empty(64), x, QuantCompressor(bits=8), traffic=traffic)
    fastcomm.collectives.all_gather(torch.empty(64), x, QuantCompressor(bits=8), traffic=traffic)
    assert traffic.calls == 2
