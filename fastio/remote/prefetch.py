"""The pass of a :class:`fastio.remote.base.RemoteSource` (steps 1 and 3 of :mod:`fastio.remote`):
:meth:`PassPrefetch.prepare` counts what each shard serves this pass and starts a prefetcher thread that
pins, reserves (in read order) and downloads shards ahead of the reads; shards read to the end are swept
(unpinned and marked read).

Example::

    source.prepare(np.array([2, 0, 1]), epoch=0, indices=np.arange(source.num_samples))
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import threading
from typing import Any

import numpy as np

from fastio.remote.progress import SharedProgress

__all__ = ["POLL_S", "PassPrefetch"]

POLL_S = 0.02


class PassPrefetch:
    """The pass half of :class:`fastio.remote.base.RemoteSource`, which owns the state it reads (the shards,
    the cache, the holds, the download pool) and provides ``_hold``, ``_release``, ``_write``,
    ``_let_go`` and the reading side."""

    # -- the pass ------------------------------------------------------------------------------------------
    def prepare(self, shard_order: np.ndarray, epoch: int, indices: np.ndarray | None = None) -> None:
        """Plan the pass (see the module docstring): count what each shard serves, start prefetching.

        Example::

            source.prepare(np.array([2, 0, 1]), epoch=0, indices=np.arange(source.num_samples))
        """
        self._stop_prefetch()
        self._drop_idle(lambda shards: True)  # the last pass's: their pins would hold shards not read soon
        order = np.asarray(shard_order, dtype=np.int64)
        expected = None
        if indices is not None:
            shard_of = np.searchsorted(self.cumulative, np.asarray(indices), side="right") - 1
            expected = np.bincount(shard_of, minlength=len(self.shards)).astype(np.float64)
            self._check_working_set(shard_of)
        for info in self.shards:
            self.cache.unmark_read(info.key)
        self._progress = SharedProgress(len(self.shards))
        self._expected = expected
        position = np.full(len(self.shards), len(order), dtype=np.int64)
        position[order] = np.arange(len(order))
        self._order_pos = position
        self._stop = threading.Event()
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                self.download_threads, thread_name_prefix="fastio-download"
            )
        self._inflight, self._failed = {}, {}
        if (
            self._full is None
            and self._keep_mapped()
            and all(self._cached(s) for s in range(len(self.shards)))
        ):
            self._full = self._whole_set()
        if self._full is not None:
            return  # every shard is cached and mapped: nothing to download, batches read the whole set
        self._prefetcher = threading.Thread(
            target=self._prefetch,
            args=(order, self._stop, self._progress),
            name="fastio-prefetch",
            daemon=True,
        )
        self._prefetcher.start()

    def _cached(self, shard: int) -> bool:
        info = self.shards[shard]
        return info.local_size is not None and self.cache.has(info.key, info.local_size)

    def _whole_set(self) -> Any:
        """The local source over every shard (each held for the source's life): what a local loader reads,
        so a cached epoch costs what a local one does."""
        everything = tuple(range(len(self.shards)))
        entry = self._entry(everything)  # holds every shard while the entry lives
        with self._lock:
            entry.refs += 1  # never idle: it is not dropped from the memo
        return entry

    def _finished(self, progress: SharedProgress, shards: np.ndarray | None = None) -> np.ndarray:
        """Which shards of this pass have had all their samples served (of ``shards`` only, when given: the
        others read False); none when the indices are unknown."""
        done = np.zeros(len(self.shards), dtype=bool)
        if self._expected is None:
            return done
        if shards is None:
            done[:] = (self._expected > 0) & (progress.consumed.sum(axis=0) >= self._expected)
        else:
            done[shards] = (self._expected[shards] > 0) & (
                progress.consumed[:, shards].sum(axis=0) >= self._expected[shards]
            )
        return done

    def _sweep(self, progress: SharedProgress) -> None:
        """Unpin the prefetched shards that are read, and mark them read for the cache."""
        with self._lock:
            held = np.array(sorted(self._prefetch_held), dtype=np.int64)
        done = self._finished(progress, held)
        with self._lock:
            finished = [s for s in self._prefetch_held if done[s]]
            self._prefetch_held.difference_update(finished)
        for shard in finished:
            self._release(shard)
            self.cache.mark_read(self.shards[shard].key)

    def _prefetch(self, order: np.ndarray, stop: threading.Event, progress: SharedProgress) -> None:
        try:
            for pos, shard in enumerate(order.tolist()):
                if pos:
                    progress.advance("reserved_front", pos - 1)
                while not stop.is_set() and pos > max(
                    progress.front("read_front") + self.ahead, progress.front("demand_front")
                ):
                    self._sweep(progress)
                    stop.wait(POLL_S)
                if stop.is_set():
                    return
                if self._expected is not None and self._expected[shard] == 0:
                    continue
                self._hold(shard)
                with self._lock:
                    self._prefetch_held.add(shard)
                info = self.shards[shard]
                if info.local_size is not None and self.cache.has(info.key, info.local_size):
                    continue
                # Published before the reservation, so a fetch that needs the shard waits for this download
                # (and its outcome) rather than starting its own.
                future: concurrent.futures.Future[None] = concurrent.futures.Future()
                self._inflight[shard] = future
                needed = functools.partial(progress.demanded, pos)
                try:
                    job = self.cache.reserve(  # in read order: waits for room, unpinning what is read
                        info.key, info.local_size, stop, self._let_go, self.cache.watch(info.key, needed)
                    )
                except BaseException as exc:
                    future.set_exception(exc)
                    raise
                if job is None:
                    future.set_result(None)
                    continue
                self._pool.submit(self._download_reserved, shard, job, future)
            progress.advance("reserved_front", len(order))
            while not stop.is_set() and self._prefetch_held:
                self._sweep(progress)
                stop.wait(POLL_S)
        except BaseException as exc:  # noqa: BLE001 - kept for the fetches of the shards not reached
            failed: concurrent.futures.Future[None] = concurrent.futures.Future()
            failed.set_exception(exc)
            for shard in order.tolist():
                if shard not in self._inflight:
                    self._inflight[shard] = failed
        finally:  # fetches stop waiting for their turn: they find the outcome, or download themselves
            progress.advance("reserved_front", len(order))

    def _download_reserved(self, shard: int, job: Any, future: concurrent.futures.Future[None]) -> None:
        try:
            failed = self._failed.get(shard)
            if failed is not None:  # a fetch's own download of it failed for good while this one waited
                raise failed
            self._write(shard, job.part)
            job.finish(lambda part: self._check_download(shard, part))
            self._after_download(shard, self.cache.path(self.shards[shard].key))
        except BaseException as exc:  # noqa: BLE001 - handed to the fetch that needs the shard
            self._failed[shard] = exc  # before the lock goes: a fetch waiting on it must see this
            job.abort()
            future.set_exception(exc)
        else:
            future.set_result(None)

    def _stop_prefetch(self) -> None:
        self._stop.set()
        if self._prefetcher is not None and self._prefetcher is not threading.current_thread():
            self._prefetcher.join(timeout=60)
        self._prefetcher = None
        for future in list(self._inflight.values()):
            with contextlib.suppress(BaseException):
                future.result(timeout=600)
        with self._lock:
            held, self._prefetch_held = list(self._prefetch_held), set()
        for shard in held:
            self._release(shard)
