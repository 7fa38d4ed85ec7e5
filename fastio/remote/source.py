"""Remote datasets as :class:`fastio.StreamLoader` sources: shards downloaded whole, ahead of the read
order, into a bounded node-local cache, then memory-mapped and read by the local sources.

* :class:`RemoteShardSource`: a fastio shard directory at a URL (``index.json`` beside the shards).
* :class:`RemoteTarSource`: WebDataset tar shards at URLs (brace lists, globs, lists), plain or compressed
  (``.tar.gz``/``.tgz``/``.tar.zst``, see :mod:`fastio.remote.compressed`).

How a pass runs:

1. :meth:`RemoteSource.prepare` (the loader calls it before the pass's first fetch) gets the shards this
   rank reads in first-read order and the pass's sample indices. It counts what each shard must serve and
   starts a prefetcher thread that walks the order, pins each shard (so no process evicts it), reserves its
   space in the cache (one shard at a time, in read order, so an earlier shard never waits behind a later
   one) and hands the download to a pool of ``download_threads`` threads, staying at most ``ahead`` shards
   past the furthest shard read so far.
2. :meth:`RemoteSource.fetch` waits (counted as ``network_wait_s``) until the prefetcher has reserved the
   room of the batch's shards (room is taken in read order only: :mod:`fastio.remote.working_set` counts on
   it) and they are in the cache, downloading a shard itself when no process has (a forked worker process
   has no prefetcher: file locks make a download once per node), then reads the batch through the local
   :class:`fastio.sources.ShardSource`/:class:`fastio.sources.TarSource` over just those cached shards
   (memoized per shard set, so consecutive batches of the same shards reuse the mapping).
3. A shard whose samples have all been served this pass is unpinned and marked read: the cache evicts it
   first. Progress is counted in shared memory made before the fork (:mod:`fastio.remote.progress`), so the
   prefetcher also sees what worker processes read; every process lets go of its pins on such shards around
   each fetch. :meth:`prepare` checks ``cache_limit`` against what the pass keeps pinned at once.
4. Once every shard is cached and the whole set fits under ``cache_limit`` (or there is none), the next
   :meth:`RemoteSource.prepare` builds one local source over every shard, keeps them pinned and mapped, and
   starts no prefetcher: later epochs read exactly as a local loader over those files does.

Resume: the loader hands :meth:`prepare` only the rest of the epoch, so a resumed run downloads only the
shards it still reads.

Sample counts come before the order. fastio shards: from ``index.json``. Tar shards, in this order of
preference: (a) a sidecar ``<shard>.fidx`` next to the remote tar (what :func:`fastio.index_tar` writes; a
small download, and the cached tar then reuses it once its bytes are checked against the sidecar's
fingerprint); (b) otherwise the shard is downloaded at open and indexed (its count, size and index are kept
beside the cache entry, so the next run opens without downloading). Compressed shards always take (b).
(a) is what a publisher should provide: opening then costs one small request per shard, not the dataset.

Example::

    loader = fastio.StreamLoader("http://127.0.0.1:8000/train/", batch_size=256, shuffle="shard",
                                 cache_dir="/tmp/fastio-cache", cache_limit="50GB", num_workers=2)
    for batch in loader:
        ...
    print(loader.stats())
"""

from __future__ import annotations

from typing import Any

from fastio.format.tar.compression import compression_of
from fastio.remote.base import RemoteSource
from fastio.remote.shard_source import RemoteShardSource
from fastio.remote.tar_source import RemoteTarSource

__all__ = ["RemoteShardSource", "RemoteSource", "RemoteTarSource", "open_remote"]


def open_remote(target: str | list[str], options: Any) -> RemoteSource:
    """The registry's opener of URLs: a :class:`RemoteTarSource` for tar shards (a name ending in ``.tar``,
    ``.tar.gz``, ``.tgz`` or ``.tar.zst``, a brace pattern or glob, a list), else a
    :class:`RemoteShardSource` (a fastio shard directory).

    Example::

        source = open_remote("http://127.0.0.1:8000/train/", OpenOptions(cache_dir="/tmp/fastio-cache"))
    """
    storage = dict(options.storage_options or {})
    common = {"cache_dir": options.cache_dir, "cache_limit": options.cache_limit, "storage_options": storage}
    if isinstance(target, list) or _looks_like_tars(target):
        return RemoteTarSource(target, decode=options.decode, tar_strict=options.tar_strict, **common)
    return RemoteShardSource(target, verify=options.verify, **common)


def _looks_like_tars(url: str) -> bool:
    path = url.split("?", 1)[0]
    return path.endswith(".tar") or compression_of(path) is not None or any(c in path for c in "*[{")
