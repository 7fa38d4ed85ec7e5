"""A local source over a set of cached shards, as :class:`fastio.remote.base.RemoteSource` memoizes it
(:class:`LocalEntry`): the source, the shards it holds, and how global indices become its own.

Example::

    entry = LocalEntry((2, 5), local_source, source.cumulative)
    batch = entry.source.fetch(indices + entry.delta[shard_ids], buffers, threads, times)
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["LocalEntry"]


class LocalEntry:
    """A local source over a set of cached shards; ``delta[s]`` turns a global index of shard ``s`` into
    the local source's index (the shard's start there minus its global start)."""

    def __init__(self, shards: tuple[int, ...], source: Any, cumulative: np.ndarray) -> None:
        self.shards, self.source, self.refs = shards, source, 0
        sizes = cumulative[1:] - cumulative[:-1]
        starts = np.concatenate([[0], np.cumsum(sizes[list(shards)])[:-1]]).astype(np.int64)
        self.delta = np.zeros(len(sizes), dtype=np.int64)
        self.delta[list(shards)] = starts - cumulative[list(shards)]
