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

import concurrent.futures
import contextlib
import dataclasses
import functools
import hashlib
import io
import json
import os
import threading
import time
import weakref
import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fastio._native import MappedFile
from fastio.errors import CorruptShardError, FastIOError, SchemaMismatchError
from fastio.format.compression import compression_of, decompress, decompressed_name
from fastio.format.decode import INT_EXTENSIONS, last_extension, npy_layout
from fastio.format.reader import ShardReader, ShardSet
from fastio.format.schema import schema_from_json
from fastio.format.tar import INDEX_SUFFIX, TarIndex, TarShardSet, load_tar_index
from fastio.remote.cache import ShardCache
from fastio.remote.fetch import (
    RangeReader,
    RemoteError,
    RemoteNotFoundError,
    RetryPolicy,
    download,
    expand_urls,
    read_bytes,
    redact,
    remote_size,
    with_retries,
)
from fastio.remote.progress import COUNTERS, SharedProgress
from fastio.remote.room import RoomWatch
from fastio.remote.working_set import ReadPlan, check_batch, check_pass
from fastio.sources import BatchBuffers, ShardSource, StageTimes, TarSource
from fastio.sources.base import Source, torch_dtype
from fastio.sources.tar import TarLayout

__all__ = ["RemoteShardSource", "RemoteSource", "RemoteTarSource", "open_remote"]

_MEMO = 8  # local sources kept for recent shard sets
_POLL_S = 0.02


@dataclasses.dataclass
class _Shard:
    """One shard: where it is, what the cache calls it, and its sizes (``local_size``: bytes of the cached
    file, None until known for a compressed shard; ``index_bytes``: what is cached beside it and evicted with
    it, a tar's index)."""

    url: str
    key: str
    remote_size: int
    local_size: int | None
    compression: str | None
    num_samples: int = 0
    index_bytes: int = 0

    @property
    def footprint(self) -> int:
        """Bytes the shard takes in the cache."""
        return (self.local_size or self.remote_size) + self.index_bytes


def _cache_key(url: str, name: str) -> str:
    """``<digest of the shard's folder URL>/<name>``: one folder per remote folder, without credentials."""
    folder = redact(url).rsplit("/", 1)[0]
    return f"{hashlib.sha256(folder.encode()).hexdigest()[:16]}/{name}"


_SOURCES: weakref.WeakSet[RemoteSource] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for source in list(_SOURCES):
        source._reset_after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


class _Entry:
    """A local source over a set of cached shards; ``delta[s]`` turns a global index of shard ``s`` into
    the local source's index (the shard's start there minus its global start)."""

    def __init__(self, shards: tuple[int, ...], source: Any, cumulative: np.ndarray) -> None:
        self.shards, self.source, self.refs = shards, source, 0
        sizes = cumulative[1:] - cumulative[:-1]
        starts = np.concatenate([[0], np.cumsum(sizes[list(shards)])[:-1]]).astype(np.int64)
        self.delta = np.zeros(len(sizes), dtype=np.int64)
        self.delta[list(shards)] = starts - cumulative[list(shards)]


class RemoteSource(Source):
    """What the remote sources share: the cache, the prefetcher, the progress counts, the memoized local
    sources (see the module docstring). Subclasses say how a cached shard is opened and read.

    Args:
        shards: the shards in storage order (filled by the subclass).
        name: what errors and progress bars call the source.
        cache: the node-local cache.
        retry: the retry policy of every remote read.
        storage_options: fsspec options (``endpoint_url``, ``anon``...).
        download_threads: concurrent shard downloads.
        ahead: shards downloaded past the furthest shard read so far (the cache limit bounds it too).
    """

    requires_shard_order = True
    per_sample = False

    def _init_remote(
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
        self.shards: list[_Shard] = []
        self._lock = threading.Lock()
        self._memo: OrderedDict[tuple[int, ...], _Entry] = OrderedDict()
        self._opened: dict[int, tuple[Any, int]] = {}  # shard -> (opened, inode of the cached file)
        self._holds: dict[int, int] = {}
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._inflight: dict[int, concurrent.futures.Future[None]] = {}
        self._failed: dict[int, BaseException] = {}  # downloads of this pass that failed for good
        self._prefetcher: threading.Thread | None = None
        self._stop = threading.Event()
        self._progress: SharedProgress | None = None
        self._expected: np.ndarray | None = None
        self._order_pos: np.ndarray | None = None
        self._prefetch_held: set[int] = set()
        self._full: Any = None  # one local source over every shard, once the whole set is cached and kept
        self._plan = ReadPlan()
        _SOURCES.add(self)

    def _finish_init(self) -> None:
        self.shard_sizes = [s.num_samples for s in self.shards]
        self.num_samples = int(sum(self.shard_sizes))
        self.cumulative = np.concatenate([[0], np.cumsum(self.shard_sizes)]).astype(np.int64)
        self._progress = SharedProgress(len(self.shards))

    # -- what subclasses provide ---------------------------------------------------------------------------
    def _open_shard(self, shard: int, path: Path) -> Any:
        """The opened cached shard (a reader, an index and its mapping)."""
        raise NotImplementedError

    def _local_source(self, shards: tuple[int, ...], opened: list[Any]) -> Any:
        """A local source over the opened ``shards`` (their samples back to back, in that order)."""
        raise NotImplementedError

    def _check_download(self, shard: int, part: Path) -> None:
        """Refuse downloaded bytes that are not the shard (a header, a checksum); default: none."""

    def _after_download(self, shard: int, path: Path) -> None:
        """Work once a shard is in the cache (a tar's sidecar beside it); default: none."""

    # -- bringing shards in --------------------------------------------------------------------------------
    def _write(self, shard: int, part: Path) -> None:
        """Download shard ``shard`` into ``part`` (decompressing it on the way when compressed)."""
        info = self.shards[shard]
        progress = self._progress

        def counted(n: int) -> None:
            if progress is not None:
                progress.add("downloaded_bytes", n)

        def retried(attempt: int, cause: str) -> None:
            if progress is not None:
                progress.add("retries", 1)

        if info.compression is None:
            download(info.url, part, info.remote_size, self.retry, self.storage_options, counted, retried)
        else:
            raw = RangeReader(info.url, info.remote_size, self.retry, self.storage_options, counted, retried)
            with raw, open(part, "r+b" if part.exists() else "wb") as out:
                try:
                    written = decompress(raw, info.compression, out)
                except (RemoteError, FastIOError, ImportError):
                    raise
                except Exception as exc:  # the decompressor's own errors (gzip: OSError/EOFError, ZstdError)
                    raise CorruptShardError(
                        redact(info.url), "compressed stream", f"a whole {info.compression} stream", repr(exc)
                    ) from None
                out.truncate(written)
        if progress is not None:
            progress.add("downloads", 1)

    def _materialize(self, shard: int, watch: RoomWatch | None = None) -> Path:
        """Shard ``shard`` in the cache (the caller holds it), downloading it here if no process has."""
        info = self.shards[shard]
        if info.local_size is not None and self.cache.has(info.key, info.local_size):
            return self.cache.path(info.key)
        job = self.cache.reserve(info.key, info.local_size, on_wait=self._let_go, watch=watch)
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
            job.finish(lambda part: self._check_download(shard, part))
            self._after_download(shard, self.cache.path(info.key))
        return self.cache.path(info.key)

    def _hold(self, shard: int) -> None:
        with self._lock:
            count = self._holds.get(shard, 0)
            self._holds[shard] = count + 1
        if count == 0:
            self.cache.pin(self.shards[shard].key)

    def _release(self, shard: int) -> None:
        with self._lock:
            count = self._holds[shard] - 1
            if count:
                self._holds[shard] = count
                return
            del self._holds[shard]
            if not self._keep_mapped():
                self._opened.pop(shard, None)  # it may be evicted: a mapping would hold the disk
        self.cache.unpin(self.shards[shard].key)

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
            watch = self.cache.watch(info.key)
            self._await_turn(shard, watch)
            future = self._inflight.get(shard) if self._owner() else None
            if future is not None:
                future.result()
            return self._materialize(shard, watch)
        finally:
            if self._progress is not None:
                self._progress.add("network_wait_s", time.perf_counter() - start)

    def _await_turn(self, shard: int, watch: RoomWatch) -> None:
        """Wait until the prefetcher has room for ``shard``: room is taken in read order only, so a shard a
        batch needs never waits behind one read after it (what :mod:`fastio.remote.working_set` relies on)."""
        progress, position = self._progress, self._order_pos
        if progress is None or position is None or position[shard] >= len(position):
            return  # no pass prepared, or a shard the pass does not read: nothing to wait for
        info = self.shards[shard]
        while progress.front("reserved_front") < position[shard]:
            self._let_go()
            watch.check(info.local_size or info.remote_size)
            time.sleep(_POLL_S)

    def _owner(self) -> bool:
        return self._progress is not None and os.getpid() == self._progress.owner

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
                    stop.wait(_POLL_S)
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
                stop.wait(_POLL_S)
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
        self._opened, self._holds, self._inflight, self._failed = {}, {}, {}, {}
        self._pool, self._prefetcher, self._prefetch_held = None, None, set()
        self._stop = threading.Event()
        if self._progress is not None:
            self._progress.lock = threading.Lock()

    # -- reading -------------------------------------------------------------------------------------------
    def _entry(self, shards: tuple[int, ...]) -> _Entry:
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
                    kept = (self._open_shard(shard, path), inode)
                    with self._lock:
                        self._opened[shard] = kept
                opened.append(kept[0])
            entry = _Entry(shards, self._local_source(shards, opened), self.cumulative)
        except BaseException:
            for shard in shards:
                self._release(shard)
            raise
        dropped: list[_Entry] = []
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
        entry = self._entry(tuple(shards.tolist()))
        try:
            batch = entry.source.fetch(indices + entry.delta[shard_ids], buffers, threads, times)
        finally:
            with self._lock:
                entry.refs -= 1
        if progress is not None:
            progress.add_consumed(shards, counts.astype(np.float64), front)
            done = self._finished(progress, shards)
            if not self._owner():  # the planning process's prefetcher marks its own
                for shard in shards[done[shards]].tolist():
                    self.cache.mark_read(self.shards[shard].key)
            self._let_go()
        return batch

    def plan_reads(
        self, batch_size: int, batches_in_flight: int = 1, worker_processes: bool = False,
        ranks_share_cache: bool = False,
    ) -> None:  # fmt: skip
        """Say how the next passes fetch (:class:`fastio.remote.working_set.ReadPlan`): what :meth:`prepare`
        checks ``cache_limit`` against. :class:`fastio.StreamLoader` calls it before each pass.

        Example::

            source.plan_reads(batch_size=256, batches_in_flight=4, worker_processes=True)
        """
        self._plan = ReadPlan(batch_size, batches_in_flight, worker_processes, ranks_share_cache)

    def _check_working_set(self, shard_of: np.ndarray) -> None:
        """Raise :class:`CacheFullError` before the pass when ``cache_limit`` cannot hold what the pass keeps
        pinned at once: it would otherwise stall on its own pins."""
        footprints = np.array([s.footprint for s in self.shards], dtype=np.int64)
        resident = self._resident_bytes()
        check_pass(self.cache.directory, self.cache.limit, shard_of, footprints, self._plan, resident)

    def _check_fits(self, shards: np.ndarray) -> None:
        """Raise :class:`CacheFullError` at once when the shards one batch reads together cannot all be in
        the cache: waiting for room would wait on the batch's own pins."""
        if self.cache.limit is not None and len(shards) > 1:
            footprints = [self.shards[s].footprint for s in shards.tolist()]
            check_batch(self.cache.directory, self.cache.limit, footprints)

    def _resident_bytes(self) -> int:
        """Bytes the source keeps in the cache that no eviction frees; default: none."""
        return 0

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
            done = self._finished(progress, np.unique(np.concatenate([np.array(k, np.int64) for k in idle])))
            self._drop_idle(lambda k: bool(done[list(k)].any()))
        if self._owner():
            self._sweep(progress)

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


def _cache_for(cache_dir: str | os.PathLike[str] | None, cache_limit: int | str | None) -> ShardCache:
    return ShardCache(cache_dir, cache_limit)


class RemoteShardSource(RemoteSource):
    """A fastio shard directory at a URL (``<url>/index.json`` and the shard files it lists), read through
    the shard cache (see the module docstring). Each download is checked against ``index.json``'s
    ``file_nbytes`` (and a ``crc32`` or ``sha256`` there, when the writer put one) and the shard's own header
    before it becomes visible; the sections' crc32 are checked once per process on first read, as for local
    shards (``verify``).

    Args:
        url: the directory's URL (``s3://bucket/train/``, ``http://host/train``).
        cache_dir, cache_limit: the node-local cache (:class:`fastio.remote.cache.ShardCache`).
        storage_options: fsspec options.
        retry: :class:`fastio.remote.fetch.RetryPolicy` of every remote read.
        verify: as :class:`fastio.StreamLoader`'s ``verify``.
        download_threads, ahead: see :class:`RemoteSource`.

    Example::

        source = RemoteShardSource("http://127.0.0.1:8000/train", cache_dir="/tmp/fastio-cache")
        loader = fastio.StreamLoader(source, batch_size=64, shuffle="shard")
    """

    def __init__(
        self,
        url: str,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_limit: int | str | None = None,
        storage_options: dict[str, Any] | None = None,
        retry: RetryPolicy | None = None,
        verify: bool | None = None,
        download_threads: int = 4,
        ahead: int = 8,
    ) -> None:
        root = url.rstrip("/")
        self._init_remote(
            root, _cache_for(cache_dir, cache_limit), retry or RetryPolicy(), storage_options,
            download_threads, ahead,
        )  # fmt: skip
        self.verify = verify
        index_url = f"{root}/index.json"
        raw = read_bytes(index_url, self.retry, self.storage_options)
        try:
            index = json.loads(raw)
        except ValueError as exc:
            raise CorruptShardError(redact(index_url), "index", "UTF-8 JSON", repr(exc)) from None
        if not isinstance(index, dict) or index.get("format") != "fastio-shards":
            found = index.get("format") if isinstance(index, dict) else type(index).__name__
            raise CorruptShardError(redact(index_url), "format", "fastio-shards", found)
        try:
            self.schema = schema_from_json(index.get("schema", {}))
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptShardError(
                redact(index_url), "schema", "{field: {kind, dtype, shape}}", repr(exc)
            ) from None
        entries = index.get("shards")
        if not isinstance(entries, list) or not entries:
            raise CorruptShardError(redact(index_url), "shards", "a non-empty list", repr(entries)[:80])
        self._checksums: list[dict[str, Any]] = []
        for i, entry in enumerate(entries):
            ok = isinstance(entry, dict) and isinstance(entry.get("file"), str)
            ok = ok and all(isinstance(entry.get(k), int) for k in ("num_samples", "file_nbytes"))
            name = entry.get("file", "") if isinstance(entry, dict) else ""
            if not ok or name.startswith("/") or ".." in name.split("/"):
                raise CorruptShardError(
                    redact(index_url),
                    f"shards[{i}]",
                    "{file (relative), num_samples, file_nbytes}",
                    repr(entry),
                )
            shard_url = f"{root}/{name}"
            size = entry["file_nbytes"]
            self.shards.append(
                _Shard(shard_url, _cache_key(shard_url, name), size, size, None, entry["num_samples"])
            )
            self._checksums.append({k: entry[k] for k in ("crc32", "sha256") if k in entry})
        self._finish_init()

    def fixed_specs(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        return {n: (torch_dtype(f.np_dtype), f.shape) for n, f in self.schema.items() if f.kind == "fixed"}

    def _check_download(self, shard: int, part: Path) -> None:
        wanted = self._checksums[shard]
        if wanted:
            crc, sha = 0, hashlib.sha256()
            with open(part, "rb") as fh:
                while block := fh.read(1 << 22):
                    crc = zlib.crc32(block, crc)
                    sha.update(block)
            if "crc32" in wanted and crc != wanted["crc32"]:
                raise CorruptShardError(
                    self.shards[shard].url, "download", f"crc32 {wanted['crc32']:#010x}", f"crc32 {crc:#010x}"
                )
            if "sha256" in wanted and sha.hexdigest() != wanted["sha256"]:
                raise CorruptShardError(
                    self.shards[shard].url,
                    "download",
                    f"sha256 {wanted['sha256']}",
                    f"sha256 {sha.hexdigest()}",
                )
        ShardReader(part, verify=False)  # the header, sizes and sections: a wrong file never gets its name

    def _open_shard(self, shard: int, path: Path) -> ShardReader:
        reader = ShardReader(path, verify=self.verify)
        info = self.shards[shard]
        if reader.num_samples != info.num_samples:
            raise CorruptShardError(
                str(path), "num_samples", f"{info.num_samples} (index.json)", reader.num_samples
            )
        for name, field in self.schema.items():
            if reader.schema.get(name) != field:
                found = reader.schema[name].describe() if name in reader.schema else "no such field"
                raise SchemaMismatchError(info.url, name, f"{field.describe()} (index.json)", found)
        return reader

    def _local_source(self, shards: tuple[int, ...], opened: list[ShardReader]) -> ShardSource:
        return ShardSource(ShardSet.from_readers(self.name, self.schema, opened))


@dataclasses.dataclass
class _TarMeta:
    """What the source keeps per tar shard beside its cache entry: enough to open without downloading."""

    remote_size: int
    tar_size: int
    num_samples: int
    fields: list[str]
    present: list[bool]  # per field: in every sample of the shard
    uniform: list[int]  # per field: the one member size of every sample, or -1
    index_bytes: int = 0  # the index cached beside the tar


def _meta_of(index: TarIndex, tar_size: int, remote_size: int, index_bytes: int) -> _TarMeta:
    present = (index.sizes >= 0).all(axis=0) if index.num_samples else np.zeros(len(index.fields), bool)
    uniform = [
        int(col[0]) if len(col) and (col == col[0]).all() and col[0] >= 0 else -1 for col in index.sizes.T
    ]
    fields = list(index.fields)
    return _TarMeta(remote_size, tar_size, index.num_samples, fields, present.tolist(), uniform, index_bytes)


class RemoteTarSource(RemoteSource):
    """WebDataset tar shards at URLs (or local compressed tars), read through the shard cache: plain tars
    are downloaded whole, compressed ones decompressed once on the way in (see the module docstring for how
    sample counts are known before the order).

    Batches are what :class:`fastio.sources.TarSource` gives over the same tars (fields as WebDataset names
    them, ``__key__``): a ``.npy`` field whose members have one size throughout the set and an int field
    present in every sample come as tensors, everything else decoded per sample. A ``.npy`` field of one
    size whose header differs between shards raises :class:`fastio.SchemaMismatchError` naming the shard (a
    remote set cannot be scanned whole before its first batch); pass ``decode=`` a callable to decode it
    yourself.

    Args:
        urls: a URL, brace pattern or glob (``http://host/shard-{000..099}.tar``), or a list of them; local
            paths work too (compressed tars).
        cache_dir, cache_limit, storage_options, retry, download_threads, ahead: as
            :class:`RemoteShardSource`.
        decode: as :class:`fastio.StreamLoader`'s ``decode``.
        tar_strict: as :class:`fastio.StreamLoader`'s ``tar_strict``.

    Example::

        source = RemoteTarSource("http://127.0.0.1:8000/shard-{000..009}.tar", cache_dir="/tmp/fastio-cache")
        loader = fastio.StreamLoader(source, batch_size=64, shuffle="shard", num_workers=2)
    """

    def __init__(
        self,
        urls: str | Sequence[str],
        cache_dir: str | os.PathLike[str] | None = None,
        cache_limit: int | str | None = None,
        storage_options: dict[str, Any] | None = None,
        retry: RetryPolicy | None = None,
        decode: Any = None,
        tar_strict: bool = True,
        download_threads: int = 4,
        ahead: int = 8,
    ) -> None:
        listed = expand_urls(urls, storage_options)
        if not listed:
            raise RemoteNotFoundError(str(urls), "the pattern names no shard")
        name = listed[0] if len(listed) == 1 else f"{listed[0]} (+{len(listed) - 1})"
        self._init_remote(
            name, _cache_for(cache_dir, cache_limit), retry or RetryPolicy(), storage_options,
            download_threads, ahead,
        )  # fmt: skip
        if decode is not None and decode != "pil" and not callable(decode):
            raise ValueError(f"decode must be None, 'pil' or a callable, got {decode!r}")
        self.decode, self.tar_strict = decode, tar_strict
        self._sidecars: dict[int, bytes] = {}
        # Sizes, sidecars and (without sidecars) whole downloads at open go download_threads at a time.
        with concurrent.futures.ThreadPoolExecutor(
            download_threads, thread_name_prefix="fastio-open"
        ) as pool:
            sizes = list(pool.map(lambda url: remote_size(url, self.retry, self.storage_options), listed))
            for url, size in zip(listed, sizes, strict=True):
                key = _cache_key(url, decompressed_name(url))
                self.shards.append(_Shard(url, key, size, None, compression_of(url)))
            metas = list(pool.map(self._meta, range(len(self.shards))))
        for info, meta in zip(self.shards, metas, strict=True):
            info.local_size, info.num_samples = meta.tar_size, meta.num_samples
            info.index_bytes = meta.index_bytes
        self._layout = self._plan_layout(metas)
        self._finish_init()

    # -- opening -------------------------------------------------------------------------------------------
    def _meta_path(self, shard: int) -> Path:
        return Path(f"{self.cache.path(self.shards[shard].key)}.meta.json")

    def _resident_bytes(self) -> int:
        """The metas: kept for good, so that the next run opens without downloading."""
        paths = [self._meta_path(s) for s in range(len(self.shards))]
        return sum(p.stat().st_size for p in paths if p.exists())

    def _meta(self, shard: int) -> _TarMeta:
        """The shard's meta: kept from an earlier run, else from a remote sidecar, else by indexing it."""
        info = self.shards[shard]
        meta_path = self._meta_path(shard)
        with contextlib.suppress(OSError, ValueError, TypeError):
            meta = _TarMeta(**json.loads(meta_path.read_text()))
            if meta.remote_size == info.remote_size:
                return meta
        meta = None
        if info.compression is None:
            try:
                sidecar = read_bytes(info.url + INDEX_SUFFIX, self.retry, self.storage_options)
            except RemoteNotFoundError:
                sidecar = None
            if sidecar is not None:
                meta = self._meta_from_sidecar(shard, sidecar)
        if meta is None:  # download (and decompress) the shard now and index it
            self._hold(shard)
            try:
                info.local_size = None if info.compression else info.remote_size
                path = self._materialize(shard)
                index = load_tar_index(path, strict=self.tar_strict)
                index_path = Path(f"{path}{INDEX_SUFFIX}")
                index_bytes = index_path.stat().st_size if index_path.exists() else 0
                meta = _meta_of(index, path.stat().st_size, info.remote_size, index_bytes)
            finally:
                self._release(shard)
        meta_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = meta_path.with_name(f".{meta_path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
        tmp.write_text(json.dumps(dataclasses.asdict(meta)))
        os.replace(tmp, meta_path)
        return meta

    def _meta_from_sidecar(self, shard: int, sidecar: bytes) -> _TarMeta | None:
        info = self.shards[shard]
        try:
            with np.load(io.BytesIO(sidecar), allow_pickle=False) as data:
                identity = data["identity"]
                index = TarIndex(info.url, data["keys"], [str(f) for f in data["fields"]],
                                 data["offsets"], data["sizes"])  # fmt: skip
        except (OSError, ValueError, KeyError):
            return None  # not a sidecar this fastio reads: index the shard instead
        if int(identity[1]) != info.remote_size:
            return None  # the sidecar describes another version of the tar
        self._sidecars[shard] = sidecar
        return _meta_of(index, info.remote_size, info.remote_size, len(sidecar))

    def _after_download(self, shard: int, path: Path) -> None:
        """Put the remote sidecar beside the cached tar with the tar's mtime set to what the sidecar recorded,
        so the tar is not re-scanned (:func:`fastio.format.tar.load_tar_index` still checks its fingerprint
        of the bytes and rebuilds on any mismatch)."""
        sidecar = self._sidecars.get(shard)
        if sidecar is None:
            return
        with np.load(io.BytesIO(sidecar), allow_pickle=False) as data:
            mtime_ns = int(data["identity"][2])
        os.utime(path, ns=(mtime_ns, mtime_ns))
        target = Path(f"{path}{INDEX_SUFFIX}")
        tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}-{threading.get_ident()}")
        tmp.write_bytes(sidecar)
        os.replace(tmp, target)

    def _plan_layout(self, metas: list[_TarMeta]) -> TarLayout:
        """The field decisions of the whole set, as a local TarSource over every tar would make them: a
        ``.npy`` field of one member size in every sample of every shard is gathered fixed (its dtype and
        shape read from the first member), an int field present in every sample is an int64 tensor."""
        fields: dict[str, None] = {}
        for meta in metas:
            fields.update(dict.fromkeys(meta.fields))
        npy: dict[str, tuple[np.dtype, tuple[int, ...], int]] = {}
        ints: list[str] = []
        if callable(self.decode):
            return TarLayout(tuple(fields), npy, ())
        for field in fields:
            where = [m.fields.index(field) if field in m.fields else -1 for m in metas]
            if any(j < 0 or not m.present[j] for m, j in zip(metas, where, strict=True)):
                continue
            kind = last_extension(field)
            if kind == "npy":
                sizes = {m.uniform[j] for m, j in zip(metas, where, strict=True)}
                if len(sizes) == 1 and -1 not in sizes:
                    spec = self._npy_spec(field, sizes.pop())
                    if spec is not None:
                        npy[field] = spec
            elif kind in INT_EXTENSIONS:
                ints.append(field)
        return TarLayout(tuple(fields), npy, tuple(ints))

    def _npy_spec(self, field: str, size: int) -> tuple[np.dtype, tuple[int, ...], int] | None:
        """(dtype, shape, header bytes) of ``field`` from the first sample of the first shard (the shard's
        start of the member read remotely when it is not cached; compressed shards are cached at open)."""
        shard = 0
        info = self.shards[shard]
        head_len = min(size, 4096)
        path = self.cache.path(info.key)
        sidecar = self._sidecars.get(shard)
        if sidecar is not None:
            with np.load(io.BytesIO(sidecar), allow_pickle=False) as data:
                fields = [str(f) for f in data["fields"]]
                offset = int(data["offsets"][0, fields.index(field)])
            url = info.url

            def head() -> bytes:
                from fastio.remote.fetch import filesystem

                fs, fspath = filesystem(url, self.storage_options, self.retry.timeout)
                return bytes(fs.cat_file(fspath, start=offset, end=offset + head_len))

            first = with_retries(head, url, self.retry)
        else:
            self._hold(shard)
            try:
                path = self._materialize(shard)
                index = load_tar_index(path, strict=self.tar_strict)
                offset = int(index.offsets[0, index.fields.index(field)])
                with open(path, "rb") as fh:
                    fh.seek(offset)
                    first = fh.read(head_len)
            finally:
                self._release(shard)
        dtype, shape, fortran, header = npy_layout(first, size, info.url, f"{field} of the first sample")
        if fortran or dtype.hasobject or not dtype.isnative:
            return None
        return dtype, tuple(shape), header

    def fixed_specs(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        specs = {n: (torch_dtype(dtype), shape) for n, (dtype, shape, _) in self._layout.npy_fixed.items()}
        specs.update({name: (torch.int64, ()) for name in self._layout.ints})
        return specs

    # -- reading -------------------------------------------------------------------------------------------
    def _open_shard(self, shard: int, path: Path) -> tuple[TarIndex, MappedFile]:
        index = load_tar_index(path, strict=self.tar_strict)
        info = self.shards[shard]
        if index.num_samples != info.num_samples:
            raise CorruptShardError(
                str(path), "samples", f"{info.num_samples} (when the source opened)", index.num_samples
            )
        return index, MappedFile(path)

    def _local_source(self, shards: tuple[int, ...], opened: list[tuple[TarIndex, MappedFile]]) -> TarSource:
        paths = [str(self.cache.path(self.shards[s].key)) for s in shards]
        subset = TarShardSet.from_parts(paths, [o[0] for o in opened], [o[1] for o in opened])
        return TarSource(subset, decode=self.decode, layout=self._layout)


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
