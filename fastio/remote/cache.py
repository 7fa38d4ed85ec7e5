"""A node-local cache of shards (whole, or parts of them), shared by every rank, worker and process of a node.

Layout under ``cache_dir`` (default ``$FASTIO_CACHE``, else ``~/.cache/fastio``): each entry is a file at
its key (a relative path the source picks), beside two empty lock files, ``<key>.lock`` (held exclusively
while the entry is downloaded) and ``<key>.pin`` (held shared by every process reading it).

1. :meth:`ShardCache.fill` brings an entry in once per node: under the entry's download lock it checks
   whether another process already did; if not, it reserves the space (evicting, see 3), writes a temporary
   ``.<name>.part-<pid>-<thread>`` file, verifies it (size, then the caller's check: a checksum, a header)
   and renames it into place, so a partial download is never visible under the entry's name. What is kept
   beside the entry (a format's sidecar, such as an index: ``extra`` bytes) is reserved with it, as a
   placeholder file ``.<name>.index.part-<pid>-<thread>`` that makes way for the sidecar under
   ``.fastio-cache.lock``; the sidecars' suffixes (``sidecars=``, given by the format) are evicted with the
   entry.
2. A pinned entry (:meth:`ShardCache.pin`: a shared ``flock`` on ``<key>.pin``, held by an open descriptor)
   is never evicted. Pins are per open file, so they hold across processes; a forked worker drops the
   descriptors it inherited (they stay with the parent) and takes its own.
3. Space: with ``cache_limit`` set, a reservation first evicts unpinned entries until the new one fits,
   entries marked read (:meth:`ShardCache.mark_read`: read this epoch) first, least recently used
   otherwise; it then starts only while the bytes in the cache (every file of the cache folder: entries,
   sidecars, reservations and their placeholders, lock files: what :meth:`ShardCache.usage` reports) plus
   the new entry's sidecar are at most the limit, so the cache folder holds at most the limit plus one
   shard's file (a download whose process died, its temporary file, is removed first); then files kept for
   good (``kept=``) that this process's source does not need. When every entry is pinned it waits for a
   pin to go, as :mod:`fastio.remote.room` says (a wait a batch needs raises :class:`CacheStalledError`
   once nothing can change). Reservations are made one at a time under ``.fastio-cache.lock``.

The recency of an entry is the mtime of its pin file (set on every pin); :meth:`mark_read` moves it back by
``_READ_SHIFT_S`` so read entries sort before any unread one while keeping their order.

Example::

    cache = ShardCache("/tmp/fastio-cache", cache_limit="50GB")
    with cache.pinned("ds/shard-000.bin"):
        path = cache.fill("ds/shard-000.bin", 4096, lambda tmp: download(url, tmp, 4096, RetryPolicy()))
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from fastio.files.paths import LOCAL_COPIES, default_cache_dir
from fastio.remote.locks import close_held, close_lock, flock, open_lock, try_flock
from fastio.remote.reservation import Reservation
from fastio.remote.room import CacheFullError, CacheStalledError, RoomWatch, alive, part_owner

__all__ = [
    "CacheFullError", "CacheStalledError", "Reservation", "ShardCache", "parse_size",
]  # fmt: skip

_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)(b?)\s*$", re.IGNORECASE)
_LOCK_SUFFIXES = (".lock", ".pin")
_GLOBAL_LOCK = ".fastio-cache.lock"
_READ_SHIFT_S = 1e9  # ~31 years: a read entry's recency sorts before every unread one
_POLL_S = 0.05


def parse_size(value: int | str | None) -> int | None:
    """Bytes of ``"50GB"``, ``"512MB"``, ``"1.5GiB"``, ``"800k"`` or an int; None stays None (no limit).
    Decimal units (GB = 10**9) unless an ``i`` makes them binary (GiB = 2**30).

    Example::

        assert parse_size("512MB") == 512 * 10**6 and parse_size("1KiB") == 1024
    """
    if value is None:
        return None
    if isinstance(value, bool):
        raise TypeError(f"cache_limit must be bytes (int) or a size like '50GB', got {value!r}")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"cache_limit must be > 0 bytes, got {value}")
        return value
    match = _SIZE.match(str(value))
    if match is None:
        raise ValueError(
            f"cache_limit: cannot read {value!r} as a size (e.g. '50GB', '512MB', '1.5GiB', 10**9)"
        )
    number, unit, binary, _ = match.groups()
    scale = 1024 ** "bkmgt".index(unit.lower()) if binary and unit else _UNITS[unit.lower()]
    size = int(float(number) * scale)
    if size <= 0:
        raise ValueError(f"cache_limit must be > 0 bytes, got {value!r}")
    return size


def _waited(cancel: threading.Event | None) -> bool:
    """Sleep one poll; True when ``cancel`` was set."""
    if cancel is not None:
        return cancel.wait(_POLL_S)
    time.sleep(_POLL_S)
    return False


_CACHES: weakref.WeakSet[ShardCache] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for cache in list(_CACHES):
        cache._forget_inherited_pins()


os.register_at_fork(after_in_child=_after_fork_in_child)


class ShardCache:
    """Whole shards on local disk, bounded by ``cache_limit`` (see the module docstring).

    Args:
        cache_dir: where entries live (created); default :func:`default_cache_dir`.
        cache_limit: bytes (int) or a size string (``"50GB"``); None: no limit.
        wait_s: how long a reservation a batch needs waits for room before :class:`CacheFullError`.
        stall_s: how long such a reservation waits while nothing in the cache can change (every entry pinned,
            no download in progress, no pin taken or let go) before :class:`CacheStalledError`.
        sidecars: suffixes of the files a format keeps beside an entry (``<entry><suffix>``, an index built
            from it), evicted with the entry; the cache knows no format, its user names them.
        kept: suffixes of files a source keeps for good (no pin file): evicted after every unpinned entry,
            oldest first, but for those in ``protected`` (this process's source's); made again when needed.

    Example::

        cache = ShardCache(cache_limit="512MB")
        print(cache.usage(), cache.limit)
    """

    def __init__(
        self, cache_dir: str | os.PathLike[str] | None = None, cache_limit: int | str | None = None,
        wait_s: float = 600.0, stall_s: float = 10.0, sidecars: Sequence[str] = (), kept: Sequence[str] = (),
    ) -> None:  # fmt: skip
        self.directory = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        self.directory.mkdir(parents=True, exist_ok=True)
        self.limit = parse_size(cache_limit)
        self.wait_s, self.stall_s = float(wait_s), float(stall_s)
        self.sidecars, self.kept, self.protected = tuple(sidecars), tuple(kept), set[Path]()
        self._lock = threading.RLock()  # a finalizer may unpin on a thread that holds it
        self._pins: dict[str, tuple[int, int]] = {}  # key -> (descriptor holding the shared flock, count)
        self.evictions = 0
        _CACHES.add(self)
        weakref.finalize(self, close_held, self._pins)  # a cache dropped with pins lets go of them
        self.clear_stale_parts()

    # -- names -------------------------------------------------------------------------------------------
    def path(self, key: str) -> Path:
        """Where entry ``key`` lives (whether or not it is there).

        Example::

            cache.path("ds/shard-000.bin").exists()
        """
        if not key or key.startswith("/") or ".." in Path(key).parts or key.endswith(_LOCK_SUFFIXES):
            raise ValueError(
                f"cache key {key!r}: expected a relative path without '..' and not ending in .lock/.pin"
            )
        return self.directory / key

    def has(self, key: str, size: int | None = None) -> bool:
        """True when entry ``key`` is there (of ``size`` bytes, when given)."""
        with contextlib.suppress(FileNotFoundError):
            actual = self.path(key).stat().st_size  # raises when it is not there
            return size is None or actual == size
        return False

    # -- pins --------------------------------------------------------------------------------------------
    def pin(self, key: str) -> None:
        """Keep ``key`` from eviction until as many :meth:`unpin` calls (counted per process); marks it used.

        Example::

            cache.pin("ds/shard-000.bin")
        """
        pin_path = Path(str(self.path(key)) + ".pin")
        with self._lock:
            fd, count = self._pins.get(key, (-1, 0))
            if count == 0:
                pin_path.parent.mkdir(parents=True, exist_ok=True)
                fd = open_lock(pin_path)
                fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while an evictor holds it for a moment
            self._pins[key] = (fd, count + 1)
        os.utime(pin_path)

    def unpin(self, key: str) -> None:
        """Undo one :meth:`pin` of ``key``; the last one lets it be evicted."""
        with self._lock:
            fd, count = self._pins.get(key, (-1, 0))
            if count == 0:
                raise ValueError(f"cache key {key!r} is not pinned by this process")
            if count == 1:
                del self._pins[key]
                close_lock(fd)
            else:
                self._pins[key] = (fd, count - 1)

    @contextlib.contextmanager
    def pinned(self, key: str) -> Iterator[None]:
        """``pin(key)`` for the duration of a ``with`` block."""
        self.pin(key)
        try:
            yield
        finally:
            self.unpin(key)

    def pinned_keys(self) -> list[str]:
        """Keys this process pins now."""
        with self._lock:
            return sorted(self._pins)

    def mark_read(self, key: str) -> None:
        """Say ``key`` was read this epoch: evicted before any entry not marked (see the module docstring)."""
        pin_path = Path(str(self.path(key)) + ".pin")
        with contextlib.suppress(FileNotFoundError):
            st = pin_path.stat()
            if st.st_mtime > _READ_SHIFT_S:  # not marked yet
                when = st.st_mtime - _READ_SHIFT_S
                os.utime(pin_path, (when, when))

    def unmark_read(self, key: str) -> None:
        """Undo :meth:`mark_read` (a new epoch reads it again), keeping its recency."""
        pin_path = Path(str(self.path(key)) + ".pin")
        with contextlib.suppress(FileNotFoundError):
            st = pin_path.stat()
            if st.st_mtime <= _READ_SHIFT_S:
                when = st.st_mtime + _READ_SHIFT_S
                os.utime(pin_path, (when, when))

    def _forget_inherited_pins(self) -> None:
        """In a forked child: drop the parent's pin descriptors without unlocking (the parent keeps them)."""
        self._lock = threading.RLock()
        self._pins.clear()  # their descriptors were closed with every other lock descriptor

    # -- space -------------------------------------------------------------------------------------------
    def _walk(self) -> Iterator[tuple[str, list[str]]]:
        """``(folder, file names)`` of the cache's own tree: not :data:`fastio.files.paths.LOCAL_COPIES`, the
        local copies other parts of fastio keep in the same directory."""
        for root, dirs, files in os.walk(self.directory):
            if root == str(self.directory):
                dirs[:] = [d for d in dirs if d != LOCAL_COPIES]
            yield root, files

    def usage(self) -> int:
        """Bytes in the cache folder now, every file counted: entries, their sidecars, downloads in progress
        and the sidecars they will write (at their full size, reserved up front), lock files. What
        ``cache_limit`` bounds.

        Example::

            assert cache.usage() <= cache.limit + largest_shard
        """
        total = 0
        for root, files in self._walk():
            for name in files:
                with contextlib.suppress(FileNotFoundError):
                    total += os.stat(os.path.join(root, name)).st_size
        return total

    def _entries(self) -> list[tuple[bool, float, Path, Path | None]]:
        """``(kept, recency, data path, pin path)`` of every complete entry, oldest (or read) first, then of
        every kept file not ``protected`` (pin path None), oldest first."""
        found: list[tuple[bool, float, Path, Path | None]] = []
        for root, files in self._walk():
            names = set(files)
            for name in files:
                path = Path(root, name)
                if self.kept and name.endswith(self.kept) and path not in self.protected:
                    with contextlib.suppress(FileNotFoundError):
                        found.append((True, path.stat().st_mtime, path, None))
                if not name.endswith(".pin") or name[: -len(".pin")] not in names:
                    continue
                with contextlib.suppress(FileNotFoundError):
                    found.append((False, path.stat().st_mtime, Path(root, name[: -len(".pin")]), path))
        return sorted(found)

    def _evict_until(self, needed: int) -> int:
        """Evict unpinned entries (read first, then LRU), then kept files not ``protected``, until ``needed``
        more bytes fit; returns usage."""
        assert self.limit is not None
        used = self.usage()
        for _, _, data, pin_path in self._entries():
            if used + needed <= self.limit:
                break
            used -= self._evict(data, pin_path) or 0
        return used

    def _evict(self, data: Path, pin_path: Path | None) -> int | None:
        """Remove one entry and its sidecars unless a process pins it (``pin_path`` None: a kept file, made
        again if needed); the bytes freed, None when pinned. Under ``.fastio-cache.lock``."""
        fd = -1 if pin_path is None else open_lock(pin_path)
        try:
            if fd >= 0 and not try_flock(fd):
                return None  # pinned by some process: being read or about to be
            freed = 0
            for victim in (data, *(Path(f"{data}{suffix}") for suffix in self.sidecars)):
                with contextlib.suppress(FileNotFoundError):
                    freed += victim.stat().st_size
                    victim.unlink()
            self.evictions += 1
            return freed
        finally:
            if fd >= 0:
                close_lock(fd)

    def discard(self, key: str) -> int:
        """Remove entry ``key``, every entry of a part of it (``<key>@...``) and their sidecars, except those
        a process pins now: what a source calls when it learns the bytes cached under ``key`` are not the
        object's any more (republished with the same size and validators). The entries removed.

        Example::

            cache.discard("3f0c.../shard-000.bin")   # the shard and its parts fetched again when read
        """
        whole = self.path(key)
        prefix, removed = f"{whole.name}@", 0
        with flock(self.directory / _GLOBAL_LOCK, fcntl.LOCK_EX):
            for kept, _, data, pin_path in self._entries():
                ours = data == whole or (data.parent == whole.parent and data.name.startswith(prefix))
                if ours and not kept and self._evict(data, pin_path) is not None:
                    removed += 1
        return removed

    def _reserve(
        self, job: Reservation, cancel: threading.Event | None, on_wait: Callable[[], None] | None,
        watch: RoomWatch,
    ) -> bool:  # fmt: skip
        """Make ``job.part`` a ``size``-byte file (empty when the size is not known) and its placeholder an
        ``extra``-byte one once the cache has room for them (see the module docstring); False when
        ``cancel`` was set meanwhile."""
        job.part.parent.mkdir(parents=True, exist_ok=True)
        needed, extra = job.size or 0, job.extra
        if self.limit is not None and extra > self.limit:  # fits no cache of this limit, pinned or not
            raise CacheFullError(
                str(self.directory), self.limit, 0, needed + extra,
                f"cannot hold what {job.dest.name} keeps beside it ({extra} bytes: the index or metadata made"
                f" from it, reserved before it is made); raise cache_limit to at least {extra} bytes", extra,
            )  # fmt: skip
        while True:
            with flock(self.directory / _GLOBAL_LOCK, fcntl.LOCK_EX):
                used = self._evict_until(needed + extra) if self.limit is not None else 0
                if self.limit is None or used + extra <= self.limit:
                    for path, nbytes in ((job.part, needed), (job.room, extra))[: 2 if extra else 1]:
                        with open(path, "wb") as fh:
                            fh.truncate(nbytes)  # counted at full size from now on (sparse until written)
                    return True
                if self.clear_stale_parts():
                    continue  # a process that died mid-download left its reserved room: take it now
            if on_wait is not None:
                on_wait()  # e.g. let go of pins that are no longer needed, so room can appear
            watch.check(needed, extra)
            if _waited(cancel):
                return False

    # -- filling -----------------------------------------------------------------------------------------
    def watch(self, key: str, needed: Callable[[], bool] | None = None) -> RoomWatch:
        """A :class:`fastio.remote.room.RoomWatch` for a wait on entry ``key``; ``needed()`` says whether a
        batch waits for it now (None: always)."""
        return RoomWatch(self.directory, key, self.limit, self.stall_s, self.wait_s, needed)

    def reserve(
        self,
        key: str,
        size: int | None,
        cancel: threading.Event | None = None,
        on_wait: Callable[[], None] | None = None,
        watch: RoomWatch | None = None,
        extra: int = 0,
    ) -> Reservation | None:
        """Start making entry ``key`` (``size`` bytes; None: not known yet, e.g. a shard being decompressed,
        and ``extra`` bytes of what is written beside it, see :meth:`Reservation.finish`):
        None when it is there already (or another process made it while this one waited for the entry's
        download lock), or when ``cancel`` is set while waiting; else a :class:`Reservation` holding that
        lock and a ``size``-byte temporary file counted against the limit. Blocks while the cache has no
        room (see the module docstring), calling ``on_wait()`` between tries and ``watch`` (default
        :meth:`watch` ``(key)``: a batch needs it), which decides how the wait may end. The caller should
        hold a :meth:`pin` so the entry stays.

        Example::

            job = cache.reserve("ds/shard-000.bin", 4096)
            if job is not None:
                download(url, job.part, 4096, RetryPolicy())
                job.finish()
        """
        dest = self.path(key)
        if self.has(key, size):
            return None
        dest.parent.mkdir(parents=True, exist_ok=True)
        watch = watch or self.watch(key)
        fd = open_lock(f"{dest}.lock")
        try:
            while not try_flock(fd):  # one download per entry per node; its holder may wait for room
                if on_wait is not None:
                    on_wait()
                watch.check(size or 0, extra)
                if _waited(cancel):
                    close_lock(fd)
                    return None
            job = Reservation(dest, size, fd, extra, self.directory / _GLOBAL_LOCK)
            if self.has(key, size) or not self._reserve(job, cancel, on_wait, watch):
                job.abort()
                return None
        except BaseException:
            close_lock(fd)
            raise
        return job

    def fill(
        self,
        key: str,
        size: int | None,
        write: Callable[[Path], object],
        check: Callable[[Path], None] | None = None,
    ) -> Path:
        """The path of entry ``key`` (``size`` bytes), made by ``write(temporary path)`` unless some process
        made it already (:meth:`reserve`, then :meth:`Reservation.finish` with ``check``).

        Example::

            cache.fill("ds/listing", n, lambda tmp: tmp.write_bytes(data))
        """
        job = self.reserve(key, size)
        if job is not None:
            try:
                write(job.part)
            except BaseException:
                job.abort()
                raise
            job.finish(check)
        return self.path(key)

    def keep(self, key: str, data: bytes) -> bool:
        """Write the small file ``key`` (``data``: what a source keeps for good, e.g. a shard's metadata)
        under the cache's lock, evicting unpinned entries for its room; False, and nothing written, when
        the cache has no room for it now (every entry pinned): what it saves is then made again next time.

        Example::

            cache.keep("ds/shard-000.bin.counts", b'{"num_samples": 60}')
        """
        dest = self.path(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        with flock(self.directory / _GLOBAL_LOCK, fcntl.LOCK_EX):
            if self.limit is not None and self._evict_until(len(data)) + len(data) > self.limit:
                return False
            part = dest.with_name(f".{dest.name}.part-{os.getpid()}-{threading.get_ident()}")
            part.write_bytes(data)  # named as a download's part: removed as stale if this process dies here
            os.replace(part, dest)
        return True

    def clear_stale_parts(self) -> int:
        """Remove temporary files of downloads whose process is gone (a crash mid-download); returns how many.

        Example::

            ShardCache("/tmp/c").clear_stale_parts()
        """
        removed = 0
        for root, files in self._walk():
            for name in files:
                if part_owner(name) is None or alive(part_owner(name)):
                    continue
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(root, name))
                    removed += 1
        return removed
