"""Remote datasets for :class:`fastio.StreamLoader`: object stores and HTTP through fsspec, a bounded
node-local shard cache, compressed tar shards.

* :mod:`fastio.remote.fetch`: reading objects with a bounded retry policy, errors naming the URL.
* :mod:`fastio.remote.cache`: the shard cache (whole shards, file locks, pins, eviction under a limit);
  :mod:`fastio.remote.room`: how a reservation waits for room, and the errors of a full cache.
* :mod:`fastio.remote.working_set`: what a pass keeps pinned at once, checked against ``cache_limit``.
* :mod:`fastio.remote.progress`: a pass's progress, shared with its worker processes.
* :mod:`fastio.remote.source`: :class:`RemoteShardSource` (:mod:`~fastio.remote.shard_source`) and
  :class:`RemoteTarSource` (:mod:`~fastio.remote.tar_source`) over :mod:`fastio.remote.base` and
  :mod:`fastio.remote.prefetch`.
* :mod:`fastio.remote.compressed`: ``.tar.gz``/``.tgz``/``.tar.zst`` shards, decompressed once into the cache.

Importing this package imports fsspec; ``import fastio`` does not (the registry opens URLs through
``fastio.remote.source:open_remote`` at their first use).

Example::

    loader = fastio.StreamLoader("http://127.0.0.1:8000/train/", batch_size=256, shuffle="shard",
                                 cache_dir="/tmp/fastio-cache", cache_limit="50GB")
"""

from fastio.remote.cache import CacheFullError, CacheStalledError, ShardCache, parse_size
from fastio.remote.fetch import (
    RemoteAccessError,
    RemoteError,
    RemoteNotFoundError,
    RemoteReadError,
    RetryPolicy,
)
from fastio.remote.source import RemoteShardSource, RemoteSource, RemoteTarSource, open_remote

__all__ = [
    "CacheFullError",
    "CacheStalledError",
    "RemoteAccessError",
    "RemoteError",
    "RemoteNotFoundError",
    "RemoteReadError",
    "RemoteShardSource",
    "RemoteSource",
    "RemoteTarSource",
    "RetryPolicy",
    "ShardCache",
    "open_remote",
    "parse_size",
]
