"""fastio.remote.working_set: the cache_limit a pass needs is the most, over the batches the consumer waits
for, of the bytes pinned then less the last shard admitted, computed here against a direct count."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from fastio.remote.room import CacheFullError
from fastio.remote.working_set import check_batch, check_pass, working_set
from fastio.sources import ReadPlan


def _direct(shard_of: np.ndarray, footprints: np.ndarray, plan: ReadPlan, resident: int) -> int:
    """The same bound, batch by batch and shard by shard."""
    batch = np.arange(len(shard_of)) // plan.batch_size
    n_batches = int(batch[-1]) + 1
    spans = {int(s): (int(batch[shard_of == s].min()), int(batch[shard_of == s].max()))
             for s in set(shard_of)}  # fmt: skip
    needed = 0
    for c in range(n_batches):
        pinned = [s for s, (first, last) in spans.items() if first - plan.lead <= c <= last + plan.lag]
        if pinned:
            total = sum(int(footprints[s]) for s in pinned)
            needed = max(needed, total - min(int(footprints[s]) for s in pinned))
    return needed + resident


@pytest.mark.parametrize("case", range(40))
def test_the_bound_equals_a_direct_count(case):
    rng = np.random.default_rng(zlib.crc32(repr(("working_set", case)).encode()))
    num_shards = int(rng.integers(1, 9))
    shard_of = rng.integers(0, num_shards, int(rng.integers(1, 80)))
    footprints = rng.integers(1, 1000, num_shards)
    plan = ReadPlan(int(rng.integers(1, 7)), int(rng.integers(1, 5)), bool(case % 2), bool(case % 3 == 0))
    resident = int(rng.integers(0, 50))
    expected = _direct(shard_of, footprints, plan, resident)
    assert working_set(shard_of, footprints, plan, resident).needed == expected


def test_shards_read_one_after_another_need_no_more_than_the_slack():
    # One shard open at a time: each is admitted while the cache holds nothing pinned beside it.
    shard_of = np.repeat(np.arange(5), 13)
    pinned = working_set(shard_of, np.full(5, 700), ReadPlan(batch_size=4))
    assert pinned.needed == 700  # the batch that ends one shard and starts the next holds both
    assert working_set(shard_of, np.full(5, 700), ReadPlan(batch_size=13)).needed == 0


def test_worker_processes_and_ranks_sharing_the_cache_need_more():
    shard_of = np.repeat(np.arange(6), 10)
    footprints = np.full(6, 100)
    alone = working_set(shard_of, footprints, ReadPlan(batch_size=5, batches_in_flight=4)).needed
    processes = working_set(shard_of, footprints, ReadPlan(5, 4, worker_processes=True)).needed
    ranks = working_set(shard_of, footprints, ReadPlan(5, 4, ranks_share_cache=True)).needed
    assert alone == 0 and processes == 200 and ranks == 200  # 3 shards pinned at once: 2 beside the last


def test_the_errors_name_a_limit_the_check_accepts():
    shard_of = np.array([0, 1, 2, 0, 1, 2, 3, 3])
    footprints = np.array([300, 500, 400, 600])
    plan = ReadPlan(batch_size=3)
    with pytest.raises(CacheFullError) as refused:
        check_pass("/cache", 100, shard_of, footprints, plan)
    suggested = refused.value.suggested_limit
    assert f"at least {suggested} bytes" in str(refused.value)
    check_pass("/cache", suggested, shard_of, footprints, plan)
    with pytest.raises(CacheFullError):
        check_pass("/cache", suggested - 1, shard_of, footprints, plan)
    with pytest.raises(CacheFullError) as refused:
        check_batch("/cache", 100, [300, 500, 400])
    assert refused.value.suggested_limit == 900  # the smallest may be the last in: the others must fit
    check_batch("/cache", 900, [300, 500, 400])
