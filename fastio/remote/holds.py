"""What a remote source holds in its shard cache (:class:`SourceHolds`): its pins, counted per cache key,
and the stop of its running prefetcher; all of it let go at once by :meth:`SourceHolds.drop` when the source
is closed or dropped. Nothing here refers to the source, so a finalizer of the source can call ``drop``:
dropping the last reference to a loader releases its pins even while its prefetcher thread runs.

Example::

    holds = SourceHolds(cache)
    holds.hold("ds/shard-000.bin")
    weakref.finalize(source, holds.drop)   # the pins go with the source
"""

from __future__ import annotations

import contextlib
import threading

from fastio.remote.cache import ShardCache

__all__ = ["SourceHolds"]


class SourceHolds:
    """A source's pins in ``cache`` (counted per key: the cache pins a key once per process, whoever
    asks) and ``stop``, the event that stops its running prefetcher (None: none runs).

    Example::

        holds = SourceHolds(ShardCache("/tmp/fastio-cache"))
        holds.hold("ds/shard-000.bin")
        assert holds.release("ds/shard-000.bin")   # the last hold: the cache may evict it now
    """

    def __init__(self, cache: ShardCache) -> None:
        self.cache = cache
        self.stop: threading.Event | None = None
        self._lock = threading.RLock()  # drop() may run in a finalizer, on any thread
        self._counts: dict[str, int] = {}

    def hold(self, key: str) -> None:
        """One more hold of ``key``; the first pins it in the cache."""
        with self._lock:
            count = self._counts.get(key, 0)
            self._counts[key] = count + 1
        if count == 0:
            self.cache.pin(key)

    def release(self, key: str) -> bool:
        """Undo one :meth:`hold` of ``key``; True when it was the last (the key is unpinned)."""
        with self._lock:
            count = self._counts[key] - 1
            if count:
                self._counts[key] = count
                return False
            del self._counts[key]
        self.cache.unpin(key)
        return True

    def drop(self) -> None:
        """Stop the running prefetcher (without waiting for it) and let go of every pin (idempotent)."""
        if self.stop is not None:
            self.stop.set()
        with self._lock:
            counts, self._counts = self._counts, {}
        for key in counts:  # pinned once per key, however many holds
            with contextlib.suppress(ValueError):  # the cache forgot it already (a fork's child)
                self.cache.unpin(key)

    def forget_after_fork(self) -> None:
        """In a forked child: the parent's holds and prefetcher stay with the parent."""
        self._lock = threading.RLock()
        self._counts, self.stop = {}, None
