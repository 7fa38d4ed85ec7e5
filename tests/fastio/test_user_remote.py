"""The remote cache as a user meets it (fastio.remote.cache): the cases a hunt for hangs and unhelpful errors
found, each failing before its fix."""

from __future__ import annotations

import time

import pytest

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
