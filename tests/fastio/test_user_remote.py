"""The remote cache as a user meets it (fastio.remote.cache): the cases a hunt for hangs and unhelpful errors
found, each failing before its fix."""

from __future__ import annotations

import fcntl
import gc
import os
import time
from pathlib import Path

import pytest

import fastio
from fastio.remote.cache import CacheFullError, CacheStalledError, ShardCache


def test_an_entry_whose_index_exceeds_the_limit_is_refused_at_once(tmp_path) -> None:
    # A remote tar without a .fidx reserves room for its index, sized as the tar until indexed: a cache_limit
    # under that waited stall_s in an empty cache, then said "raise cache_limit to at least 0 bytes".
    cache = ShardCache(tmp_path, cache_limit=60_000, stall_s=2.0)
    start = time.monotonic()
    with pytest.raises(CacheFullError) as refused:
        cache.reserve("ds/shard-0.tar", 71_680, extra=71_680)
    assert time.monotonic() - start < 1.0 and not isinstance(refused.value, CacheStalledError)
    assert refused.value.suggested_limit == 71_680 and "shard-0.tar" in str(refused.value)
    assert "at least 71680 bytes" in str(refused.value) and not cache.has("ds/shard-0.tar")


def test_kept_files_no_source_here_needs_make_way_for_an_entry(tmp_path) -> None:
    # Files a source keeps for good (a tar's .meta.json / .meta.fidx) had no pin file and were never evicted:
    # another dataset's filled a shared cache_dir (then a reservation stalled, "every entry pinned").
    cache = ShardCache(tmp_path, cache_limit=12_000, stall_s=1.0, kept=(".meta.fidx",))
    for name in ("old/a.tar.meta.fidx", "old/b.tar.meta.fidx", "ds/c.tar.meta.fidx"):
        cache.path(name).parent.mkdir(parents=True, exist_ok=True)
        cache.path(name).write_bytes(b"i" * 4_000)
    cache.protected.add(cache.path("ds/c.tar.meta.fidx"))  # this process's source needs it
    job = cache.reserve("ds/d.tar", 3_000)
    assert job is not None
    job.part.write_bytes(b"t" * 3_000)
    job.finish()
    assert cache.has("ds/d.tar") and cache.has("ds/c.tar.meta.fidx")  # the protected one stays
    assert not cache.has("old/a.tar.meta.fidx") and cache.has("old/b.tar.meta.fidx")  # oldest first
    assert cache.usage() <= 12_000


def _pinned(cache_dir: Path) -> list[str]:
    """The entries some open file pins now: their pin files cannot be locked exclusively."""
    pinned = []
    for pin in sorted(cache_dir.rglob("*.pin")):
        fd = os.open(pin, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pinned.append(pin.name)
        finally:
            os.close(fd)
    return pinned


def test_a_loader_dropped_or_closed_lets_go_of_its_pins(shard_dir, server, tmp_path, fio) -> None:
    # A loader dropped mid-epoch kept its shards pinned until the process ended (its prefetcher thread kept
    # the source alive; a whole set cached was pinned by descriptors nothing closed), so a second loader on
    # a small cache stalled; StreamLoader had no close() nor ``with``.
    sizes = [p.stat().st_size for p in shard_dir.glob("*.fio")]
    limited = fastio.RemoteOptions(cache_dir=tmp_path / "cache", cache_limit=sum(sizes) // 3)
    args = dict(batch_size=4, shuffle="shard", seed=3, order=fastio.OrderOptions(shuffle_window=1))
    loader = fastio.StreamLoader(server.url("train/"), remote=limited, **args)
    batches = iter(loader)
    next(batches)
    assert _pinned(tmp_path / "cache")
    del loader, batches
    gc.collect()
    deadline = time.monotonic() + 10.0  # a download in flight holds the source until it ends
    while _pinned(tmp_path / "cache") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _pinned(tmp_path / "cache") == []
    whole = fastio.RemoteOptions(cache_dir=tmp_path / "cache")  # no limit: the whole set kept pinned, mapped
    with fastio.StreamLoader(server.url("train/"), remote=whole, **args) as loader:
        for _ in range(2):
            seen = [y for batch in loader for y in fio.check_batch(batch)]
            assert sorted(seen) == list(range(fio.NUM_SAMPLES))
        assert len(_pinned(tmp_path / "cache")) == len(sizes)
    assert _pinned(tmp_path / "cache") == []
