"""The prefetcher of one pass of a :class:`fastio.remote.base.RemoteSource` (steps 1 and 3 of
:mod:`fastio.remote`): a thread that walks the pass's read order, pins each shard, reserves its room in the
cache (in read order) and hands its download to the source's pool, staying ``ahead`` shards past the
furthest shard read; shards read to the end are swept (unpinned and marked read).

It is given what it needs when built: the shards, the cache, the pass's progress and expected counts, and
four calls into its source (``hold``, ``release``, ``fill``: download a reserved shard into its entry,
``let_go``: drop the source's pins on read shards while waiting for room). It reads nothing else of the
source, and holds those calls weakly: the thread never keeps its source alive, and a source dropped
mid-pass sets the prefetcher's ``stop_event`` (:mod:`fastio.remote.holds`), which ends the thread.

Example::

    prefetcher = Prefetcher(source.shards, source.cache, order, progress, expected, ahead=8, pool=pool,
                            failed={}, hold=source._hold, release=source._release, fill=source._fill,
                            let_go=source._let_go)
    prefetcher.start()
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import inspect
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from fastio.remote.cache import ShardCache
from fastio.remote.progress import SharedProgress
from fastio.remote.room import RoomWatch
from fastio.remote.shard import Shard

__all__ = ["POLL_S", "Prefetcher", "await_turn"]

POLL_S = 0.02


def await_turn(
    progress: SharedProgress, position: int, watch: RoomWatch, shard: Shard, let_go: Callable[[], None]
) -> None:
    """Wait until the prefetcher has taken the room of ``shard``, at read-order ``position`` (its
    ``reserved_front`` reached it), calling ``let_go()`` and ``watch.check`` (the shard's file and index
    bytes) between polls: the watch ends a wait nothing can end with
    :class:`fastio.remote.room.CacheStalledError`.

    Example::

        await_turn(progress, 3, cache.watch(shard.key), shard, source._let_go)
    """
    size = shard.local_size or shard.remote_size
    while progress.front("reserved_front") < position:
        let_go()
        watch.check(size, shard.index_bytes)
        time.sleep(POLL_S)


class Prefetcher:
    """The prefetcher thread of one pass (see the module docstring).

    Args:
        shards, cache: the source's shards and cache.
        order: the shards this pass reads, in first-read order.
        progress, expected: the pass's shared progress and the samples each shard serves (None: unknown).
        ahead: shards prefetched past the furthest shard read.
        pool: the source's download threads.
        failed: this pass's downloads that failed for good (shared with the source's own downloads).
        hold, release: pin and unpin a shard through the source (counted per process).
        fill: ``fill(shard, job)`` downloads a reserved shard into its cache entry.
        let_go: the source drops its pins on shards read to the end (called while waiting for room).

    Attributes:
        inflight: shard -> the future of its download (or of the failure that stopped the prefetcher).
    """

    def __init__(
        self,
        shards: Sequence[Shard],
        cache: ShardCache,
        order: np.ndarray,
        progress: SharedProgress,
        expected: np.ndarray | None,
        *,
        ahead: int,
        pool: concurrent.futures.ThreadPoolExecutor,
        failed: dict[int, BaseException],
        hold: Callable[[int], None],
        release: Callable[[int], None],
        fill: Callable[[int, Any], None],
        let_go: Callable[[], None],
    ) -> None:
        self.shards, self.cache, self.order = shards, cache, order
        self.progress, self.expected, self.ahead = progress, expected, ahead
        self.pool, self.failed = pool, failed
        # Weakly: the thread must not keep the source alive (dropping it sets stop_event: the thread ends).
        self.hold, self.release, self.fill, self.let_go = map(_weakly, (hold, release, fill, let_go))
        self.inflight: dict[int, concurrent.futures.Future[None]] = {}
        self._held: set[int] = set()
        self._lock = threading.Lock()
        self.stop_event = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="fastio-prefetch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread, wait for the downloads it started, and unpin what it holds (idempotent)."""
        self.stop_event.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=60)
        self._thread = None
        for future in list(self.inflight.values()):
            with contextlib.suppress(BaseException):
                future.result(timeout=600)
        with self._lock:
            held, self._held = list(self._held), set()
        for shard in held:
            self.release(shard)

    def sweep(self) -> None:
        """Unpin the prefetched shards that are read, and mark them read for the cache."""
        with self._lock:
            held = np.array(sorted(self._held), dtype=np.int64)
        done = self.progress.finished(self.expected, held)
        with self._lock:
            finished = [s for s in self._held if done[s]]
            self._held.difference_update(finished)
        for shard in finished:
            self.release(shard)
            self.cache.mark_read(self.shards[shard].key)

    def _run(self) -> None:
        progress, stop = self.progress, self.stop_event
        try:
            for pos, shard in enumerate(self.order.tolist()):
                if pos:
                    progress.advance("reserved_front", pos - 1)
                while not stop.is_set() and pos > max(
                    progress.front("read_front") + self.ahead, progress.front("demand_front")
                ):
                    self.sweep()
                    stop.wait(POLL_S)
                if stop.is_set():
                    return
                if self.expected is not None and self.expected[shard] == 0:
                    continue
                self.hold(shard)
                with self._lock:
                    self._held.add(shard)
                info = self.shards[shard]
                if info.local_size is not None and self.cache.has(info.key, info.local_size):
                    continue
                # Published before the reservation, so a fetch that needs the shard waits for this download
                # (and its outcome) rather than starting its own.
                future: concurrent.futures.Future[None] = concurrent.futures.Future()
                self.inflight[shard] = future
                needed = functools.partial(progress.demanded, pos)
                try:
                    watch = self.cache.watch(info.key, needed)
                    job = self.cache.reserve(  # in read order: waits for room, unpinning what is read
                        info.key, info.local_size, stop, self.let_go, watch, info.index_bytes
                    )
                except BaseException as exc:
                    future.set_exception(exc)
                    raise
                if job is None:
                    future.set_result(None)
                    continue
                self.pool.submit(self._download, shard, job, future)
            progress.advance("reserved_front", len(self.order))
            while not stop.is_set() and self._held:
                self.sweep()
                stop.wait(POLL_S)
        except BaseException as exc:  # noqa: BLE001 - kept for the fetches of the shards not reached
            failed: concurrent.futures.Future[None] = concurrent.futures.Future()
            failed.set_exception(exc)
            for shard in self.order.tolist():
                if shard not in self.inflight:
                    self.inflight[shard] = failed
        finally:  # fetches stop waiting for their turn: they find the outcome, or download themselves
            progress.advance("reserved_front", len(self.order))

    def _download(self, shard: int, job: Any, future: concurrent.futures.Future[None]) -> None:
        try:
            failed = self.failed.get(shard)
            if failed is not None:  # a fetch's own download of it failed for good while this one waited
                raise failed
            self.fill(shard, job)
        except BaseException as exc:  # noqa: BLE001 - handed to the fetch that needs the shard
            self.failed[shard] = exc  # before the lock goes: a fetch waiting on it must see this
            job.abort()
            future.set_exception(exc)
        else:
            job.abort()  # a no-op once filled; else (the source was dropped) its room and lock go
            future.set_result(None)


def _weakly(call: Callable[..., Any]) -> Callable[..., Any]:
    """``call`` (a bound method) without a reference to its object: a no-op once the object is gone."""
    if not inspect.ismethod(call):
        return call
    method = weakref.WeakMethod(call)

    def weak_call(*args: Any) -> Any:
        bound = method()
        return None if bound is None else bound(*args)

    return weak_call
