"""fastio's own columnar shard format: a directory of ``shard-NNNNNN.fio`` files and an ``index.json``.

* :mod:`~fastio.format.shards.layout`: the byte layout of a shard file.
* :mod:`~fastio.format.shards.schema`: fields, their kinds and the schema's JSON form.
* :mod:`~fastio.format.shards.writer`: :class:`ShardWriter`.
* :mod:`~fastio.format.shards.reader`: :class:`ShardReader` (one file) and :class:`ShardSet` (a directory).
* :mod:`~fastio.format.shards.source`: :class:`ShardSource`, the directory as a batch source.
* :mod:`~fastio.format.shards.remote`: :class:`RemoteShardSource`, a directory at a URL, read through the
  node-local cache of :mod:`fastio.remote`.

Its row in :mod:`fastio.registry` is ``"fastio-shards"``.
"""

from __future__ import annotations

import os
import urllib.parse
from typing import Any

__all__ = ["is_shard_directory", "is_shard_directory_url"]


def is_shard_directory(target: Any) -> bool:
    """The registry's match of a local shard directory: a path to a directory (its ``index.json`` is checked
    when it is opened).

    Example::

        assert is_shard_directory("data/train") == os.path.isdir("data/train")
    """
    return isinstance(target, str) and os.path.isdir(target)


def is_shard_directory_url(target: Any) -> bool:
    """The registry's match of a shard directory at a URL: one whose last part names no file, nor a pattern
    (``s3://bucket/train``, ``https://host/train/``).

    Example::

        assert is_shard_directory_url("s3://bucket/train/") and not is_shard_directory_url("s3://b/x.tar")
    """
    if not isinstance(target, str):
        return False
    path = urllib.parse.urlsplit(target).path
    last = path.rstrip("/").rsplit("/", 1)[-1]
    return not any(c in path for c in "*[{") and (path.endswith("/") or "." not in last)
