"""fastio.remote.base: a fetch pins a batch's shards only once the prefetcher's turn (room taken in read
order) has reached them, cached ones included, so the pins of batches fetched ahead of the consumer never
take room the consumer's batch needs (what fastio.remote.working_set counts)."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import numpy as np

from fastio.format.shards.remote import RemoteShardSource
from fastio.sources import ReadPlan
from fastio.sources.base import StageTimes
from fastio.sources.buffers import BatchBuffers

sys.path.insert(0, str(Path(__file__).parent))
from _remote_helpers import FAST_RETRY  # noqa: E402


def _fetch(source: RemoteShardSource, indices: np.ndarray) -> dict:
    buffers = BatchBuffers(source.fixed_specs(), len(indices), False)
    return source.fetch(indices, buffers, 1, StageTimes())


def _in_thread(fn, name: str) -> tuple[threading.Thread, list]:
    """Run ``fn`` in a thread; the list gets what it returned or raised."""
    out: list = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # handed to the test
            out.append(exc)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread, out


def test_a_batch_fetched_ahead_does_not_pin_a_cached_shard_before_its_turn(server, tmp_path, fio):
    # An epoch starts with shard 2 left in the cache by the last one. The consumer's batch reads shards 0
    # and 1 together; a batch fetched ahead (a worker thread) reads part of shard 2. The limit holds one shard
    # beside the one being admitted: enough for the pass (each batch reads two shards), not for a third
    # pinned ahead of its turn. Pinned at once, shard 2 would leave no room for shard 1: the pass stalls.
    probe = RemoteShardSource(server.url("train"), cache_dir=tmp_path / "cache", retry=FAST_RETRY)
    largest = max(s.footprint for s in probe.shards)
    with probe.cached(2):
        pass
    probe.close()
    source = RemoteShardSource(server.url("train"), cache_dir=tmp_path / "cache", cache_limit=largest,
                               retry=FAST_RETRY, ahead=1)  # fmt: skip
    source.cache.stall_s = 2.0
    per = fio.SHARD_SAMPLES
    # The order of events is fixed: the fetch ahead first either pins shard 2 or waits for its turn, and only
    # then do the prefetcher's turns start (shard 0's admission would evict shard 2 were it not pinned) and
    # the consumer fetch.
    ahead_ready = threading.Event()
    hold, wait_turn = source._hold, source._await_turn

    def hold_in_order(shard: int) -> None:
        if threading.current_thread().name == "fastio-prefetch" and shard == 0:
            ahead_ready.wait(60)
        hold(shard)
        if threading.current_thread().name == "fetch-ahead" and shard == 2:
            ahead_ready.set()

    def await_turn(*args) -> None:
        if threading.current_thread().name == "fetch-ahead":
            ahead_ready.set()
        wait_turn(*args)

    source._hold, source._await_turn = hold_in_order, await_turn  # type: ignore[method-assign]
    try:
        assert source.cache.has(source.shards[2].key)
        source.plan_reads(ReadPlan(batch_size=2 * per))
        source.prepare(np.arange(len(source.shards)), epoch=1, indices=np.arange(fio.NUM_SAMPLES))
        ahead, ahead_out = _in_thread(lambda: _fetch(source, np.arange(2 * per, 2 * per + 6)), "fetch-ahead")
        assert ahead_ready.wait(60)
        consumer, consumer_out = _in_thread(lambda: _fetch(source, np.arange(0, 2 * per)), "consumer")
        consumer.join(60)
        ahead.join(60)
        assert not consumer.is_alive() and not ahead.is_alive(), "a fetch still waited after 60 s"
        for out, first, count in ((consumer_out, 0, 2 * per), (ahead_out, 2 * per, 6)):
            if isinstance(out[0], BaseException):
                raise out[0]
            assert fio.check_batch(out[0]) == list(range(first, first + count))
    finally:
        source.close()
