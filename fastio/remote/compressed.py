"""Compressed tar shards (``.tar.gz``/``.tgz``, ``.tar.zst``), local or remote: each is decompressed once,
streaming, into the shard cache (:mod:`fastio.remote.cache`), then indexed and memory-mapped like any tar
(:class:`fastio.remote.source.RemoteTarSource` does the rest: order, resume, exactly-once).

1. The compressed bytes are read through a :class:`fastio.remote.fetch.RangeReader` (ranged reads, each
   retried on transient failures) and decompressed as they arrive, written to the cache entry's temporary
   file in 1 MiB blocks: memory stays one read chunk plus one block whatever the shard's size.
2. A compressed shard's sample count needs its tar, so every compressed shard is decompressed and indexed
   when the source opens (the counts, and the decompressed size, are kept beside the cache entry, so a later
   run or a re-download after eviction does not redo that at open).
3. ``zstandard`` is an optional extra, imported only for ``.tar.zst``.

Which names are compressed tars, and the decompression itself, are :mod:`fastio.format.tar.compression`
(re-exported here); this module opens local compressed shards as a remote tar source.

Example::

    loader = fastio.StreamLoader("data/shard-{000..009}.tar.gz", batch_size=64, shuffle="shard",
                                 cache_dir="/tmp/fastio-cache")
"""

from __future__ import annotations

import os
from typing import Any

from fastio.format.tar.compression import (
    COMPRESSED_SUFFIXES,
    compression_of,
    decompress,
    decompressed_name,
    is_compressed_tar,
)
from fastio.paths import expand_pattern
from fastio.remote.source import open_remote

__all__ = [
    "COMPRESSED_SUFFIXES",
    "compression_of",
    "decompress",
    "decompressed_name",
    "is_compressed_tar",
    "open_compressed_tars",
]


def open_compressed_tars(target: str | list[str], options: Any) -> Any:
    """The registry's opener of local compressed tar shards: a
    :class:`fastio.remote.source.RemoteTarSource` over them (reading local files through fsspec), so they
    are decompressed into ``options.cache_dir`` and share the remote source's cache, order and resume.

    Example::

        source = open_compressed_tars("data/shard-{000..003}.tgz", OpenOptions(cache_dir="/tmp/c"))
    """
    paths = expand_pattern(target)
    for path in paths:
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path}: no such tar shard")
    return open_remote([os.path.abspath(p) for p in paths], options)
