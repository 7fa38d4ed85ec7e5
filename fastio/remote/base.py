"""What every remote source shares (:class:`RemoteSource`): the node-local cache, the shards brought into it
and held there, the progress counts, the plan of each pass, and the memoized local sources batches are read
through. How a pass runs is :mod:`fastio.remote`'s docstring; its prefetcher thread is
:class:`fastio.remote.prefetch.Prefetcher`, built with what it needs. A format's remote source
(``fastio/format/<name>/remote.py``) subclasses it and says what its shards are, how a cached shard is
opened, and the local source that reads them; this module knows no format.

Example::

    class MySource(RemoteSource):
        def __init__(self, url):
            super().__init__(url, ShardCache("/tmp/fastio-cache"), RetryPolicy(), {}, 4, 8)
            self.shards = [Shard(url, cache_key(url, "part-0"), 4096, 4096, num_samples=16)]
            self.shards_ready()
        def open_shard(self, shard, path): ...
        def local_source(self, shards, opened): ...
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from fastio.remote.cache import ShardCache
from fastio.remote.entry import LocalEntry
from fastio.remote.fetch import RetryPolicy, redact
from fastio.remote.holds import SourceHolds
from fastio.remote.prefetch import Prefetcher, await_turn
from fastio.remote.progress import COUNTERS, SharedProgress
from fastio.remote.room import RoomWatch
from fastio.remote.shard import Shard, write_shard
from fastio.remote.working_set import check_batch, check_pass, shards_held
from fastio.sources.base import ReadPlan, Source, StageTimes
from fastio.sources.buffers import BatchBuffers

__all__ = ["RemoteSource"]

_MEMO = 8  # local sources kept for recent shard sets
_SOURCES: weakref.WeakSet[RemoteSource] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for source in list(_SOURCES):
        source._reset_after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


class RemoteSource(Source):
    """What the remote sources share: the cache, the pass (:meth:`prepare`, its
    :class:`fastio.remote.prefetch.Prefetcher`), the progress counts, the memoized local sources (see the
    module docstring). A format's remote source subclasses it:

    1. Its constructor calls ``super().__init__(...)``, fills ``self.shards`` (:class:`Shard`, storage
       order; :meth:`cached` brings one in when its sample count needs its bytes) and calls
       :meth:`shards_ready`.
    2. It provides :meth:`open_shard` and :meth:`local_source` (how cached files are read: the format's own
       local source), :meth:`fixed_specs`, and where it needs them :meth:`check_download`,
       :meth:`after_download` and :meth:`resident_bytes`.

    Args:
        name: what errors and progress bars call the source.
        cache: the node-local cache.
        retry: the retry policy of every remote read.
        storage_options: fsspec options (``endpoint_url``, ``anon``...).
        download_threads: concurrent shard downloads.
        ahead: shards downloaded past the furthest shard read so far (the cache limit bounds it too).
    """

    requires_shard_order = True
    per_sample = False

    def __init__(
        self,
        name: str,
        cache: ShardCache,
        retry: RetryPolicy,
        storage_options: dict[str, Any] | None,
        download_threads: int,
        ahead: int,
    ) -> None:
        if download_threads < 1:
            raise ValueError(f"download_threads must be >= 1, got {download_threads}")
        if ahead < 1:
            raise ValueError(f"ahead must be >= 1, got {ahead}")
        self.name, self.cache, self.retry = redact(name), cache, retry
        self.storage_options = dict(storage_options or {})
        self.download_threads, self.ahead = download_threads, ahead
        self.shards: list[Shard] = []
        self._lock = threading.Lock()
        self._memo: OrderedDict[tuple[int, ...], LocalEntry] = OrderedDict()
        self._opened: dict[int, tuple[Any, int]] = {}  # shard -> (opened, inode of the cached file)
        self._holds = SourceHolds(cache)
        weakref.finalize(self, self._holds.drop)  # a source dropped unclosed lets go of its pins
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._failed: dict[int, BaseException] = {}  # downloads of this pass that failed for good
        self._prefetcher: Prefetcher | None = None
        self._progress: SharedProgress | None = None
        self._expected: np.ndarray | None = None  # samples each shard serves this pass (None: unknown)
        self._order_pos: np.ndarray | None = None  # each shard's place in the pass's read order
        self._full: Any = None  # one local source over every shard, once the whole set is cached and kept
        self._plan = ReadPlan()
        _SOURCES.add(self)

    def shards_ready(self) -> None:
        """Called by the subclass once ``self.shards`` holds every shard with its sample count."""
        self.shard_sizes = [s.num_samples for s in self.shards]
        self.num_samples = int(sum(self.shard_sizes))
        self.cumulative = np.concatenate([[0], np.cumsum(self.shard_sizes)]).astype(np.int64)
        self._progress = SharedProgress(len(self.shards))

    def use_units(self, units: list[Shard]) -> None:
        """Cache and read ``units`` from now on: whole shards, or the parts of them a format listed
        (:mod:`fastio.remote.parts`; storage order, so global indices stay). Between passes only: the pins,
        mappings and local sources of the units before are let go."""
        if [u.key for u in units] != [u.key for u in self.shards]:
            self.close()
            self._opened = {}
            self.shards = list(units)
            self.shards_ready()

    @contextlib.contextmanager
    def cached(self, shard: int) -> Iterator[Path]:
        """Shard ``shard``'s cached file, downloaded here if no process has, pinned while the block runs.

        Example::

            with source.cached(0) as path:
                header = path.read_bytes()[:64]
        """
        self._hold(shard)
        try:
            yield self._materialize(shard)
        finally:
            self._release(shard)

    # -- what subclasses provide ---------------------------------------------------------------------------
    def open_shard(self, shard: int, path: Path) -> Any:
        """The opened cached shard (a reader, an index and its mapping)."""
        raise NotImplementedError

    def local_source(self, shards: tuple[int, ...], opened: list[Any]) -> Any:
        """A local source over the opened ``shards`` (their samples back to back, in that order)."""
        raise NotImplementedError

    def check_download(self, shard: int, part: Path) -> None:
        """Refuse downloaded bytes that are not the shard (a header, a checksum); default: none."""

    def after_download(self, shard: int, path: Path) -> None:
        """Write what is kept beside a shard once it is in the cache (a format's sidecar, such as an index),
        at most its ``index_bytes``: the room reserved for it; default: nothing."""

    # -- the pass ------------------------------------------------------------------------------------------
    def prepare(self, shard_order: np.ndarray, epoch: int, indices: np.ndarray | None = None) -> None:
        """Plan the pass (see the module docstring): count what each shard serves, check the working set,
        start a :class:`fastio.remote.prefetch.Prefetcher` (none once the whole set is cached and kept).

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
        self._progress, self._expected = SharedProgress(len(self.shards)), expected
        position = np.full(len(self.shards), len(order), dtype=np.int64)
        position[order] = np.arange(len(order))
        self._order_pos = position
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                self.download_threads, thread_name_prefix="fastio-download"
            )
        self._failed = {}
        if self._full is None and self._keep_mapped() and all(map(self._cached, range(len(self.shards)))):
            self._full = self._whole_set()
        if self._full is not None:
            return  # every shard is cached and mapped: nothing to download, batches read the whole set
        self._prefetcher = Prefetcher(
            self.shards, self.cache, order, self._progress, expected, ahead=self.ahead, pool=self._pool,
            failed=self._failed, hold=self._hold, release=self._release, fill=self._fill, let_go=self._let_go,
        )  # fmt: skip
        self._holds.stop = self._prefetcher.stop_event  # set if the source is dropped: its thread ends
        self._prefetcher.start()

    def _stop_prefetch(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.stop()
            self._prefetcher = self._holds.stop = None

    def _cached(self, shard: int) -> bool:
        info = self.shards[shard]
        return info.local_size is not None and self.cache.has(info.key, info.local_size)

    def _whole_set(self) -> LocalEntry:
        """The local source over every shard (each held for the source's life): what a local loader reads,
        so a cached epoch costs what a local one does."""
        entry = self._entry(tuple(range(len(self.shards))))  # holds every shard while the entry lives
        with self._lock:
            entry.refs += 1  # never idle: it is not dropped from the memo
        return entry

    # -- bringing shards in --------------------------------------------------------------------------------
    def _write(self, shard: int, part: Path) -> None:
        write_shard(self.shards[shard], part, self.retry, self.storage_options, self._progress)

    def _fill(self, shard: int, job: Any) -> None:
        """Download a reserved shard into its cache entry, checked, with its after-download work."""
        self._write(shard, job.part)
        job.finish(lambda part: self.check_download(shard, part), lambda p: self.after_download(shard, p))

    def _materialize(self, shard: int, watch: RoomWatch | None = None) -> Path:
        """Shard ``shard`` in the cache (the caller holds it), downloading it here if no process has."""
        info = self.shards[shard]
        if info.local_size is not None and self.cache.has(info.key, info.local_size):
            return self.cache.path(info.key)
        job = self.cache.reserve(info.key, info.local_size, None, self._let_go, watch, info.index_bytes)
        if job is not None:
            failed = self._failed.get(shard)
            if failed is not None:  # this pass's download of it already spent the retry budget
                job.abort()
                raise failed
            try:
                self._write(shard, job.part)
            except BaseException as exc:
                self._failed[shard] = exc  # before the lock goes: a fetch waiting on it must see this
                job.abort()
                raise
            job.finish(lambda part: self.check_download(shard, part), lambda p: self.after_download(shard, p))
        return self.cache.path(info.key)

    def _hold(self, shard: int) -> None:
        self._holds.hold(self.shards[shard].key)

    def _release(self, shard: int) -> None:
        if self._holds.release(self.shards[shard].key) and not self._keep_mapped():
            with self._lock:
                self._opened.pop(shard, None)  # it may be evicted: a mapping would hold the disk

    def _keep_mapped(self) -> bool:
        """Keep shards mapped between uses when the whole set fits the cache: nothing is ever evicted then,
        and a mapping kept is one whose pages need not be faulted in again next epoch."""
        limit = self.cache.limit
        return limit is None or limit >= sum(s.footprint for s in self.shards)

    def _ensure_local(self, shard: int) -> Path:
        """Wait for (or make) the cached file of a held shard; the wait counts as network wait."""
        info = self.shards[shard]
        if info.local_size is not None and self.cache.has(info.key, info.local_size):
            return self.cache.path(info.key)
        start = time.perf_counter()
        try:
            prefetcher = self._prefetcher if self._owner() else None
            future = prefetcher.inflight.get(shard) if prefetcher is not None else None
            if future is not None:
                future.result()
            return self._materialize(shard, self.cache.watch(info.key))
        finally:
            if self._progress is not None:
                self._progress.add("network_wait_s", time.perf_counter() - start)

    def _await_turn(self, shards: np.ndarray) -> None:
        """Wait until the prefetcher has taken the room of a batch's shards (up to the last in read order)
        before the batch pins any, cached ones too: room is taken in read order only, so a shard a batch needs
        never waits behind one read after it, nor (pinned by a batch fetched ahead) behind a shard left in the
        cache; what :mod:`fastio.remote.working_set` relies on. The wait counts as network wait."""
        progress, position = self._progress, self._order_pos
        read = [] if position is None else [s for s in shards.tolist() if position[s] < len(position)]
        if progress is None or not read:
            return  # no pass prepared, or shards the pass does not read: nothing to wait for
        last = max(read, key=lambda s: position[s])
        info, start = self.shards[last], time.perf_counter()
        await_turn(progress, int(position[last]), self.cache.watch(info.key), info, self._let_go)
        progress.add("network_wait_s", time.perf_counter() - start)

    def _owner(self) -> bool:
        return self._progress is not None and os.getpid() == self._progress.owner

    def close(self) -> None:
        """Stop prefetching and release every pin (idempotent); the cache keeps what it has.

        Example::

            source.close()
        """
        self._stop_prefetch()
        with self._lock:
            memo, self._memo, self._full = list(self._memo.values()), OrderedDict(), None
        for entry in memo:
            for shard in entry.shards:
                self._release(shard)
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _reset_after_fork(self) -> None:
        """In a forked worker: no prefetcher, no pool, no pins (the cache dropped the inherited ones)."""
        self._lock = threading.Lock()
        self._memo = OrderedDict()
        self._opened, self._failed = {}, {}
        self._holds.forget_after_fork()
        self._pool, self._prefetcher = None, None  # the parent's: its thread and its pins stay there
        if self._progress is not None:
            self._progress.lock = threading.Lock()

    # -- reading -------------------------------------------------------------------------------------------
    def _entry(self, shards: tuple[int, ...]) -> LocalEntry:
        with self._lock:
            entry = self._memo.get(shards)
            if entry is not None:
                self._memo.move_to_end(shards)
                entry.refs += 1
                return entry
        for shard in shards:
            self._hold(shard)
        try:
            opened = []
            for shard in shards:
                path = self._ensure_local(shard)
                inode = os.stat(path).st_ino
                with self._lock:
                    kept = self._opened.get(shard)
                if kept is None or kept[1] != inode:  # none, or a mapping of a file evicted since
                    kept = (self.open_shard(shard, path), inode)
                    with self._lock:
                        self._opened[shard] = kept
                opened.append(kept[0])
            entry = LocalEntry(shards, self.local_source(shards, opened), self.cumulative)
        except BaseException:
            for shard in shards:
                self._release(shard)
            raise
        dropped: list[LocalEntry] = []
        with self._lock:
            existing = self._memo.get(shards)
            if existing is not None:  # another thread built it meanwhile
                existing.refs += 1
                dropped.append(entry)
                entry = existing
            else:
                entry.refs = 1
                self._memo[shards] = entry
            idle = [k for k, e in self._memo.items() if e.refs == 0]
            while len(self._memo) > _MEMO and idle:
                dropped.append(self._memo.pop(idle.pop(0)))
        for old in dropped:
            for shard in old.shards:
                self._release(shard)
        return entry

    def fetch(
        self, indices: np.ndarray, buffers: BatchBuffers, threads: int, times: StageTimes
    ) -> dict[str, Any]:
        """The batch of global ``indices``, read from the cached shards (waiting for them if needed).

        Example::

            batch = source.fetch(np.arange(8), BatchBuffers(source.fixed_specs(), 8, False), 2, StageTimes())
        """
        indices = np.asarray(indices, dtype=np.int64)
        if len(indices) and (indices.min() < 0 or indices.max() >= self.num_samples):
            raise IndexError(f"sample index out of range [0, {self.num_samples})")
        full = self._full
        if full is not None:  # the whole set is cached: global indices are the local source's own
            return full.source.fetch(indices, buffers, threads, times)
        shard_ids = np.searchsorted(self.cumulative, indices, side="right") - 1
        counts = np.bincount(shard_ids, minlength=len(self.shards))
        shards = np.flatnonzero(counts)
        counts = counts[shards]
        self._check_fits(shards)
        progress = self._progress
        front = int(self._order_pos[shards].max()) if self._order_pos is not None else -1
        if progress is not None:  # the prefetcher's reservations of these shards are needed now
            progress.advance("demand_front", front)
        self._let_go()
        self._await_turn(shards)
        entry = self._entry(tuple(shards.tolist()))
        try:
            batch = entry.source.fetch(indices + entry.delta[shard_ids], buffers, threads, times)
        finally:
            with self._lock:
                entry.refs -= 1
        if progress is not None:
            progress.add_consumed(shards, counts.astype(np.float64), front)
            done = progress.finished(self._expected, shards)
            if not self._owner():  # the planning process's prefetcher marks its own
                for shard in shards[done[shards]].tolist():
                    self.cache.mark_read(self.shards[shard].key)
            self._let_go()
        return batch

    def plan_reads(self, plan: ReadPlan) -> None:
        """How the next passes fetch (:class:`fastio.sources.ReadPlan`): what :meth:`prepare` checks
        ``cache_limit`` against. :class:`fastio.StreamLoader` calls it before each pass.

        Example::

            source.plan_reads(ReadPlan(batch_size=256, batches_in_flight=4, worker_processes=True))
        """
        self._plan = plan

    def _check_working_set(self, shard_of: np.ndarray) -> None:
        """Raise :class:`CacheFullError` before the pass when ``cache_limit`` cannot hold what the pass keeps
        pinned at once: it would otherwise stall on its own pins."""
        footprints = np.array([s.footprint for s in self.shards], dtype=np.int64)
        files = footprints - np.array([s.index_bytes for s in self.shards], dtype=np.int64)
        limit, plan = self.cache.limit, self._plan
        check_pass(self.cache.directory, limit, shard_of, footprints, plan, self.resident_bytes(), files)

    def _check_fits(self, shards: np.ndarray) -> None:
        """Raise :class:`CacheFullError` at once when the shards one batch reads together cannot all be in
        the cache: waiting for room would wait on the batch's own pins."""
        if self.cache.limit is not None and len(shards) > 1:
            footprints = [self.shards[s].footprint for s in shards.tolist()]
            check_batch(self.cache.directory, self.cache.limit, footprints)

    def resident_bytes(self) -> int:
        """Bytes the source keeps in the cache that no eviction frees; default: none."""
        return 0

    def shards_held(self) -> int | None:
        """Shards the cache holds at once (:func:`fastio.remote.working_set.shards_held`); None: all."""
        footprints = [s.footprint for s in self.shards]
        return shards_held(footprints, self.cache.limit, self.resident_bytes())

    def _let_go(self) -> None:
        """Let go of this process's pins on shards read to the end this pass (by any process): the idle local
        sources holding one and, in the planning process, the prefetched ones. Called around every fetch and
        while waiting for room, so a pin outlives the shard's last read only until the process fetches again
        (what :mod:`fastio.remote.working_set` counts)."""
        progress = self._progress
        if progress is None:
            return
        with self._lock:
            idle = [k for k, e in self._memo.items() if e.refs == 0]
        if idle:
            shards = np.unique(np.concatenate([np.array(k, np.int64) for k in idle]))
            done = progress.finished(self._expected, shards)
            self._drop_idle(lambda k: bool(done[list(k)].any()))
        if self._owner() and self._prefetcher is not None:
            self._prefetcher.sweep()

    def _drop_idle(self, stale: Callable[[tuple[int, ...]], bool]) -> None:
        """Forget the idle local sources whose shard tuple is ``stale(shards)``, and their pins."""
        with self._lock:
            dropped = [self._memo.pop(k) for k, e in list(self._memo.items()) if e.refs == 0 and stale(k)]
        for entry in dropped:
            for shard in entry.shards:
                self._release(shard)

    # -- statistics ----------------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """I/O of the current pass, summed over threads and worker processes: ``network_wait_s`` (seconds
        :meth:`fetch` waited for shards to be local; the gather itself is the loader's ``read`` stage),
        ``downloaded_bytes``, ``downloads``, ``retries``; and the cache now: ``cache_bytes``,
        ``cache_limit``, ``evictions`` (by this process).

        Example::

            s = source.stats()
            print(f"{s['downloaded_bytes'] / 1e6:.0f} MB, waited {s['network_wait_s']:.1f} s")
        """
        totals = self._progress.totals() if self._progress is not None else dict.fromkeys(COUNTERS, 0.0)
        return {
            "network_wait_s": totals["network_wait_s"],
            "downloaded_bytes": int(totals["downloaded_bytes"]),
            "downloads": int(totals["downloads"]),
            "retries": int(totals["retries"]),
            "cache_bytes": self.cache.usage(),
            "cache_limit": self.cache.limit,
            "evictions": self.cache.evictions,
        }
