"""fastio.remote.room: how a reservation waits for room in the shard cache. A wait a batch needs that
nothing can end raises CacheStalledError within stall_s and logs why it waits; a prefetch ahead of need
waits quietly until cancelled; a download in progress is progress, not a stall."""

from __future__ import annotations

import logging
import os
import pickle
import threading
from pathlib import Path

from fastio.remote.cache import CacheFullError, CacheStalledError, ShardCache


def _fill(cache: ShardCache, key: str, size: int) -> Path:
    return cache.fill(key, size, lambda part: part.write_bytes(bytes(i % 251 + 1 for i in range(size))))


def _full_cache(tmp_path: Path, **kwargs: float) -> ShardCache:
    """Two pinned 100-byte entries under a 150-byte limit: no room for a third, nothing to evict."""
    cache = ShardCache(tmp_path, cache_limit=150, **kwargs)
    for key in ("a", "b"):
        cache.pin(key)
        _fill(cache, key, 100)
    cache.pin("c")
    return cache


def _bounded(fn, timeout_s: float = 60.0) -> BaseException | None:
    """Run ``fn`` in a thread; what it raised (None: returned). A hang fails the test instead of CI."""
    raised: list[BaseException | None] = [None]

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # handed to the test below
            raised[0] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), f"still waiting after {timeout_s} s"
    return raised[0]


def test_a_needed_reservation_that_cannot_get_room_raises_stalled_and_logs(tmp_path, caplog):
    cache = _full_cache(tmp_path, stall_s=2.0)
    with caplog.at_level(logging.WARNING, logger="fastio.remote.cache"):
        raised = _bounded(lambda: cache.reserve("c", 100))
    assert isinstance(raised, CacheStalledError) and isinstance(raised, CacheFullError)
    assert raised.used == 200 and raised.needed == 100 and raised.suggested_limit == 200
    assert "nothing changed" in str(raised) and "at least 200 bytes" in str(raised)
    assert any("waited" in r.getMessage() and "every entry pinned" in r.getMessage() for r in caplog.records)
    assert not cache.has("c")


def test_a_prefetch_not_needed_yet_waits_quietly_until_cancelled(tmp_path, caplog):
    cache = _full_cache(tmp_path, stall_s=0.2)
    stop = threading.Event()
    threading.Timer(1.5, stop.set).start()
    with caplog.at_level(logging.WARNING, logger="fastio.remote.cache"):
        job = cache.reserve("c", 100, cancel=stop, watch=cache.watch("c", needed=lambda: False))
    assert job is None and stop.is_set()
    assert not caplog.records


def test_a_prefetch_raises_once_a_batch_needs_it(tmp_path):
    cache = _full_cache(tmp_path, stall_s=0.5)
    needed = threading.Event()
    threading.Timer(1.0, needed.set).start()
    raised = _bounded(lambda: cache.reserve("c", 100, watch=cache.watch("c", needed=needed.is_set)))
    assert isinstance(raised, CacheStalledError) and needed.is_set()


def test_a_download_in_progress_is_not_a_stall(tmp_path):
    # Another reader's download holds the entry's lock while it writes: the wait for it goes on as long as
    # the download does, however long past stall_s, and ends with the entry.
    cache = ShardCache(tmp_path, cache_limit=10_000, stall_s=0.3)
    other = ShardCache(tmp_path)
    job = other.reserve("d", 300)
    assert job is not None and job.part.name.startswith(".d.part-")

    def download() -> None:
        with open(job.part, "r+b") as out:
            for i in range(30):  # 1.5 s of writing, 5 x stall_s
                out.write(bytes([i + 1]) * 10)
                out.flush()
                os.utime(job.part)
                threading.Event().wait(0.05)
        job.finish()

    writer = threading.Thread(target=download)
    writer.start()
    assert _bounded(lambda: cache.reserve("d", 300)) is None
    writer.join()
    assert cache.has("d", 300)


def test_the_errors_cross_processes_whole():
    for err in (CacheStalledError("/c", 150, 200, 100, 10.0), CacheFullError("/c", 150, 0, 90, "x", 120)):
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err) and str(back) == str(err)
        assert back.suggested_limit == err.suggested_limit


def test_a_stall_names_the_limit_that_lets_the_shard_and_its_index_in(tmp_path):
    # A remote tar without a .fidx reserves its index's room (``extra``) with it, and the cache admits it
    # once what is cached plus that room fits the limit. With a limit just above one tar the stall said
    # "raise cache_limit to at least <what is pinned>", a number at or under the limit already set.
    cache = ShardCache(tmp_path, cache_limit=1_000, stall_s=0.3)
    cache.pin("a")
    _fill(cache, "a", 300)  # pinned by a reader: nothing to evict
    raised = _bounded(lambda: cache.reserve("b", 900, extra=900))
    assert isinstance(raised, CacheStalledError)
    assert (raised.used, raised.needed, raised.suggested_limit) == (300, 900, 1_200)
    assert "at least 1200 bytes" in str(raised) and "plus 900 bytes kept beside it" in str(raised)
    assert pickle.loads(pickle.dumps(raised)).suggested_limit == 1_200
    job = ShardCache(tmp_path, cache_limit=raised.suggested_limit).reserve("b", 900, extra=900)
    assert job is not None  # the limit suggested lets it in, "a" still pinned
    job.abort()
