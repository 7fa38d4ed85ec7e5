"""``shuffle=True`` on remote shards over a real HTTP server: the local full permutation where the cache holds
every shard, else, for a source that reads whole shards only (compressed tars; a fastio shard source told
not to split, here), a sliding window of the shards it holds (fastio.pipeline.order's "window"), sized to
cache_limit, reported in stats(), exact, resumable and split across ranks like every other order. Parts of
shards (what fastio shard sources and plain tars read instead) are test_remote_parts.py's and
test_remote_tar_index.py's."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest

import fastio
from fastio.format.shards.remote import RemoteShardSource

sys.path.insert(0, str(Path(__file__).parent))
from _remote_helpers import FAST_RETRY  # noqa: E402


class WholeShards(RemoteShardSource):
    """A fastio shard source that never splits its shards into parts: what a source of whole shards gets."""

    def split_shards(self, reach: int | None, parts: int | None = None) -> None:
        return super().split_shards(None)


def _source(server, cache_dir: Path, shards_held: int | None) -> RemoteShardSource:
    """A whole-shard remote source over the test set whose cache_limit holds ``shards_held`` of its largest
    shards."""
    probe = RemoteShardSource(server.url("train"), cache_dir=cache_dir, retry=FAST_RETRY)
    largest = max(s.footprint for s in probe.shards)
    probe.close()
    limit = None if shards_held is None else shards_held * largest
    return WholeShards(server.url("train"), cache_dir=cache_dir, cache_limit=limit, retry=FAST_RETRY)


def _ys(loader: fastio.StreamLoader, fio) -> list[list[int]]:
    return [fio.check_batch(batch) for batch in loader]


@pytest.mark.parametrize("shards_held", [None, 9])
def test_shuffle_true_where_the_cache_holds_every_shard_is_the_local_full_permutation(
    shard_dir, server, tmp_path, fio, shards_held
):
    source = _source(server, tmp_path / "cache", shards_held)
    try:
        for epoch in (0, 1):
            local = fastio.StreamLoader(shard_dir, batch_size=10, shuffle=True, seed=5)
            remote = fastio.StreamLoader(source, batch_size=10, shuffle=True, seed=5, num_workers=2)
            local.set_epoch(epoch)
            remote.set_epoch(epoch)
            assert _ys(remote, fio) == _ys(local, fio)
            stats = remote.stats()
            assert (stats["shuffle_mode"], stats["shuffle_window_shards"]) == ("full", 9)
    finally:
        source.close()


@pytest.mark.parametrize(
    "num_workers, worker_mode, window",
    [(0, "thread", 3), (2, "thread", 3), (2, "process", 1)],  # worker processes hold 3 batches more
)
def test_shuffle_true_under_a_cache_limit_reads_a_window_of_the_shards_it_holds(
    shard_dir, server, tmp_path, fio, num_workers, worker_mode, window
):
    source = _source(server, tmp_path / "cache", 3)
    largest = max(s.footprint for s in source.shards)
    epochs = []
    try:
        for epoch in (0, 1):
            remote = fastio.StreamLoader(source, batch_size=8, shuffle=True, seed=5, num_workers=num_workers,
                                         workers=fastio.WorkerOptions(mode=worker_mode))  # fmt: skip
            # The same order as the local set's with the window named explicitly: the mode is
            # fastio.pipeline.order's.
            local = fastio.StreamLoader(
                shard_dir,
                batch_size=8,
                shuffle="window",
                order=fastio.OrderOptions(shuffle_window=window),
                seed=5,
            )
            remote.set_epoch(epoch)
            local.set_epoch(epoch)
            ys = _ys(remote, fio)
            assert ys == _ys(local, fio)
            flat = [y for batch in ys for y in batch]
            assert sorted(flat) == list(range(fio.NUM_SAMPLES))
            stats = remote.stats()
            assert (stats["shuffle_mode"], stats["shuffle_window_shards"]) == ("window", window)
            assert stats["source"]["cache_bytes"] <= source.cache.limit + largest
            epochs.append(flat)
    finally:
        source.close()
    assert epochs[0] != epochs[1]
    assert source.cache.evictions > 0  # the limit bit: shards came and went


def test_a_window_order_resumes_with_the_same_batches(server, tmp_path, fio):
    first = _source(server, tmp_path / "cache", 3)
    loader = fastio.StreamLoader(first, batch_size=8, shuffle=True, seed=2)
    it = iter(loader)
    for _ in range(4):
        next(it)
    state = loader.state_dict()
    rest = [fio.check_batch(batch) for batch in it]
    first.close()
    second = _source(server, tmp_path / "cache", 3)
    resumed = fastio.StreamLoader(second, batch_size=8, shuffle=True, seed=2)
    resumed.load_state_dict(state)
    try:
        assert _ys(resumed, fio) == rest and resumed.stats()["shuffle_mode"] == "window"
    finally:
        second.close()


def test_a_state_saved_under_another_window_is_refused(server, tmp_path):
    three = _source(server, tmp_path / "cache", 3)
    state = fastio.StreamLoader(three, batch_size=8, shuffle=True).state_dict()
    three.close()
    four = _source(server, tmp_path / "cache", 4)
    try:
        with pytest.raises(ValueError, match="shuffle_window=3 but this loader has shuffle_window=4"):
            fastio.StreamLoader(four, batch_size=8, shuffle=True).load_state_dict(state)
    finally:
        four.close()


def test_ranks_reading_a_window_order_share_the_epoch_exactly_once(server, tmp_path, fio):
    # 117 samples over 3 ranks: 39 batches of 1 each, every sample read by exactly one rank. Ranks sharing the
    # node's cache read a few batches apart: the window leaves room for those (2 of the 3 shards held here).
    seen: Counter = Counter()
    counts, windows = [], set()
    for rank in range(3):
        source = _source(server, tmp_path / "cache", 3)
        loader = fastio.StreamLoader(
            source, batch_size=1, shuffle=True, seed=7, order=fastio.OrderOptions(rank=rank, world_size=3)
        )
        try:
            batches = _ys(loader, fio)
        finally:
            source.close()
        counts.append(len(batches))
        windows.add(loader.stats()["shuffle_window_shards"])
        seen.update(y for batch in batches for y in batch)
    assert counts == [39, 39, 39] and windows == {2}
    assert sorted(seen) == list(range(fio.NUM_SAMPLES)) and set(seen.values()) == {1}
