"""Remote shards for :class:`fastio.StreamLoader`: object stores and HTTP through fsspec, brought into a
bounded node-local cache ahead of the read order, whole or in parts (byte ranges a format lists). This
layer moves and keeps bytes; it knows no shard format (like Mosaic Streaming's downloader): each format's
remote source (``fastio/format/<name>/remote.py``) subclasses :class:`RemoteSource`, says what its shards
are, passes in what it keeps beside them (sidecar suffixes, a check, an unpacker), and reads the cached files
through its own local source.

* :mod:`fastio.remote.fetch`: reading objects with a bounded retry policy, errors naming the URL
  (:mod:`fastio.remote.errors`); :mod:`fastio.remote.identity`: an object's size and validators (ETag,
  Last-Modified...), which name its version in the cache.
* :mod:`fastio.remote.cache`: the shard cache (whole shards, file locks, pins, eviction under a limit);
  :mod:`fastio.remote.room`: how a reservation waits for room, and the errors of a full cache;
  :mod:`fastio.remote.locks`: the cache's file locks, safe across forks.
* :mod:`fastio.remote.working_set`: what a pass keeps pinned at once, checked against ``cache_limit``.
* :mod:`fastio.remote.progress`: a pass's progress, shared with its worker processes.
* :mod:`fastio.remote.shard`: one shard or part of one (:class:`Shard`) and how its bytes come into the
  cache; :mod:`fastio.remote.parts`: how many parts ``shuffle=True`` cuts shards into under a small cache.
* :mod:`fastio.remote.base`: :class:`RemoteSource` (the pass's plan, the cache, the holds, the memoized
  local sources of :mod:`fastio.remote.entry`, the reads); :mod:`fastio.remote.prefetch`: the prefetcher
  thread of a pass; :mod:`fastio.remote.holds`: the source's pins, let go of when it is closed or dropped
  (the prefetcher refers to its source weakly, so dropping a loader ends its pass).

The cache's unit is a :class:`Shard`: a whole shard, or, where a format splits them
(:meth:`RemoteSource.use_units`), a part of one; below, "shard" means either.

How a pass runs:

1. :meth:`RemoteSource.prepare` (the loader calls it before the pass's first fetch) gets the shards this
   rank reads in first-read order and the pass's sample indices. It counts what each shard must serve and
   starts a prefetcher thread that walks the order, pins each shard (so no process evicts it), reserves its
   space in the cache (one shard at a time, in read order, so an earlier shard never waits behind a later
   one) and hands the download to a pool of ``download_threads`` threads, staying at most ``ahead`` shards
   past the furthest shard read so far.
2. :meth:`RemoteSource.fetch` waits (counted as ``network_wait_s``) until the prefetcher has reserved the
   room of the batch's shards, before it pins any of them, cached ones too (room is taken in read order
   only: :mod:`fastio.remote.working_set` counts on it) and they are in the cache, downloading a shard
   itself when no process has (a forked worker process has no prefetcher: file locks make a download once
   per node), then reads the batch through the format's
   local source over just those cached shards (memoized per shard set, so consecutive batches of the same
   shards reuse the mapping).
3. A shard whose samples have all been served this pass is unpinned and marked read: the cache evicts it
   first. Progress is counted in shared memory made before the fork (:mod:`fastio.remote.progress`), so the
   prefetcher also sees what worker processes read; every process lets go of its pins on such shards around
   each fetch. :meth:`RemoteSource.prepare` checks ``cache_limit`` against what the pass keeps pinned at
   once (:meth:`RemoteSource.plan_reads` says how the loader fetches).
4. Once every shard is cached and the whole set fits under ``cache_limit`` (or there is none), the next
   :meth:`RemoteSource.prepare` builds one local source over every shard, keeps them pinned and mapped, and
   starts no prefetcher: later epochs read exactly as a local loader over those files does.

Resume: the loader hands :meth:`RemoteSource.prepare` only the rest of the epoch, so a resumed run downloads
only the shards it still reads.

Importing this package imports fsspec; ``import fastio`` does not (:mod:`fastio.registry` opens URLs through
the formats' remote openers, imported at their first use).

Example::

    loader = fastio.StreamLoader("http://127.0.0.1:8000/train/", batch_size=256, shuffle="shard",
                                 cache_dir="/tmp/fastio-cache", cache_limit="50GB")
"""

from fastio.remote.base import RemoteSource
from fastio.remote.cache import CacheFullError, CacheStalledError, ShardCache, parse_size
from fastio.remote.fetch import (
    RemoteAccessError,
    RemoteError,
    RemoteNotFoundError,
    RemoteReadError,
    RetryPolicy,
)
from fastio.remote.shard import Shard

__all__ = [
    "CacheFullError",
    "CacheStalledError",
    "RemoteAccessError",
    "RemoteError",
    "RemoteNotFoundError",
    "RemoteReadError",
    "RemoteSource",
    "RetryPolicy",
    "Shard",
    "ShardCache",
    "parse_size",
]
