"""Ending a loader before it is dropped: :class:`Closing` gives :class:`fastio.StreamLoader` ``close()`` and
the ``with`` block. What it lets go of:

1. the running pass (its worker threads or processes), and the workers kept between passes
   (``persistent_workers=True``);
2. what the source holds, through its ``close()`` where it has one (optional in the
   :class:`fastio.sources.Source` protocol): a remote source's prefetcher and download threads and its pins
   in the node cache; mixed streams close each stream's.

Dropping the last reference to a loader lets go of the same (the workers, the remote source and the cache
each have a finalizer; nothing a background thread holds keeps them alive), once the garbage collector gets
to it; ``close()`` does it at once. A closed loader may be iterated again: the next ``iter()`` starts
workers and (remote) pins and downloads anew.

Example::

    with fastio.StreamLoader("http://127.0.0.1:8000/shard-{000..009}.tar", batch_size=64) as loader:
        batch = next(iter(loader))
    # the shards it pinned may be evicted now
"""

from __future__ import annotations

from typing import Self

from fastio.pipeline.batches import Batches
from fastio.sources import Source
from fastio.workers.batch_pass import BatchPass

__all__ = ["Closing"]


class Closing:
    """``close()``, ``__enter__`` and ``__exit__`` over a loader's running pass (``_current``), its batches
    (``_batches``, whose ``kept`` workers outlive a pass) and its source (``_source``); see the module
    docstring.

    Example::

        loader = fastio.StreamLoader(url, batch_size=64)
        for batch in loader:
            break
        loader.close()   # its workers stop, its remote shards are unpinned
    """

    _current: BatchPass | None
    _batches: Batches
    _source: Source

    def close(self) -> None:
        """Stop this loader's workers and let go of what its source holds (idempotent; see the module
        docstring).

        Example::

            loader.close()
        """
        if self._current is not None:
            self._current.close()
        kept = getattr(self._batches, "kept", None)
        if kept is not None:
            kept.close()
        close = getattr(self._source, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
