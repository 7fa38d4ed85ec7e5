"""Waiting for room in the shard cache: the errors of a full cache, and the watch that tells a wait that
will end from one that cannot.

A reservation (:meth:`fastio.remote.cache.ShardCache.reserve`) waits while every entry is pinned and the
cache has no room, or while another reader holds the entry's download lock; a fetch waits for the prefetcher
to take the room of the shard it needs. What such a wait may do depends on whether a batch needs the shard
now:

1. Not needed yet (the prefetcher reserving ahead of the reads): it waits quietly for the reads to finish a
   shard, however long the consumer takes; its owner cancels it.
2. Needed: it logs a warning every ``_LOG_EVERY_S`` seconds (the first within ``stall_s / 2``), and
   raises :class:`CacheStalledError` once nothing in the cache has changed for ``stall_s`` seconds while no
   download is in progress (no entry came or went, no download wrote a byte: a pin taken frees nothing): the
   readers holding the pins are then waiting themselves, and no pin will go. After ``wait_s`` seconds needed
   it raises :class:`CacheFullError` even while the cache changes (other readers keep taking the room),
   unless a download is in progress (its retry policy bounds it).

Example::

    watch = RoomWatch(cache_dir, "ds/shard-007.bin", limit=10**8, stall_s=10, wait_s=600)
    while not admitted():
        watch.check(size=4096)
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from collections.abc import Callable
from pathlib import Path

from fastio.errors import FastIOError
from fastio.files.paths import LOCAL_COPIES

__all__ = ["CacheFullError", "CacheStalledError", "RoomWatch", "alive", "part_owner"]

_log = logging.getLogger("fastio.remote.cache")
_LOG_EVERY_S = 5.0
_SCAN_EVERY_S = 0.5
_PART = re.compile(r"^\..+\.part-(\d+)-\d+$")
_NOT_COUNTED = (".lock", ".pin", ".fastio-cache.lock")


class CacheFullError(FastIOError):
    """Every entry of the cache is pinned and the next shard does not fit under ``cache_limit``;
    ``suggested_limit`` is the limit the message advises (default: ``used``, what is pinned now).

    Example::

        err = CacheFullError("/cache", 10, 12, 4)
        assert f"at least {err.suggested_limit} bytes" in str(err)
    """

    def __init__(
        self, cache_dir: str, limit: int, used: int, needed: int, detail: str = "",
        suggested_limit: int | None = None,
    ) -> None:  # fmt: skip
        self.cache_dir, self.limit, self.used, self.needed = cache_dir, limit, used, needed
        self.detail = detail
        self.suggested_limit = used if suggested_limit is None else suggested_limit
        if detail:  # known impossible at once: no waiting for pins that cannot go
            message = f"{cache_dir}: cache_limit {limit} bytes {detail}"
        else:
            message = (
                f"{cache_dir}: cache_limit {limit} bytes is full ({used} bytes, every entry pinned: being"
                f" read or about to be) and the next shard needs {needed} bytes; raise cache_limit to at"
                f" least {self.suggested_limit} bytes (what is pinned now, and the room of what the next"
                " shard keeps beside it), or give readers that share this cache_dir their own"
            )
        super().__init__(message)

    def __reduce__(self) -> tuple:  # rebuilt from its fields when it crosses from a worker process
        args = (self.cache_dir, self.limit, self.used, self.needed, self.detail, self.suggested_limit)
        return (type(self), args)


class CacheStalledError(CacheFullError):
    """A batch needs a shard the cache has no room for, and none will come: every entry is pinned, no
    download is in progress and nothing in the cache changed for ``stalled_s`` seconds. ``extra``: the bytes
    the shard keeps beside it (its index), which the cache admits only under the limit; the limit that lets
    the shard in, ``suggested_limit``, is ``used + extra`` (the shard's own file may pass the limit).

    Example::

        err = CacheStalledError("/cache", 10, 12, 4, 10.0, extra=3)
        assert isinstance(err, CacheFullError) and "at least 15 bytes" in str(err)
    """

    def __init__(
        self, cache_dir: str, limit: int, used: int, needed: int, stalled_s: float, extra: int = 0
    ) -> None:
        self.stalled_s, self.extra = stalled_s, extra
        beside = f", plus {extra} bytes kept beside it" if extra else ""
        detail = (
            f"has no room for the next shard ({needed} bytes{beside}): {used} bytes are cached, every entry"
            f" pinned by a reader, no download in progress, and nothing changed for {stalled_s:.0f} s, so no"
            f" pin will go. Raise cache_limit to at least {used + extra} bytes (what is cached now{beside}:"
            " what lets this shard in); the limit a pass needs is checked when it starts, so pins beyond it"
            " belong to other processes or ranks sharing this cache_dir: count theirs too, or give each its"
            " own cache_dir"
        )
        super().__init__(cache_dir, limit, used, needed, detail, used + extra)

    def __reduce__(self) -> tuple:
        return (type(self), (self.cache_dir, self.limit, self.used, self.needed, self.stalled_s, self.extra))


def _scan(directory: Path) -> tuple[int, int, bool]:
    """``(bytes counted against the limit, a fingerprint of the files that make room, whether a live process
    is downloading)``. The fingerprint changes when an entry comes or goes or a download writes; not when a
    pin is taken or marked read (a lock or pin file comes or is touched), which frees nothing by itself."""
    used, seen, downloading = 0, [], False
    for root, dirs, files in os.walk(directory):
        if root == str(directory):  # other parts of fastio's local copies: not the cache's, not counted
            dirs[:] = [d for d in dirs if d != LOCAL_COPIES]
        for name in files:
            if name.endswith(_NOT_COUNTED):
                continue
            with contextlib.suppress(FileNotFoundError):
                st = os.stat(os.path.join(root, name))
                seen.append((root, name, st.st_size, st.st_mtime_ns))
                used += st.st_size
                owner = part_owner(name)
                if owner is not None and not downloading:
                    downloading = alive(owner)
    return used, hash(tuple(sorted(seen))), downloading


def part_owner(name: str) -> int | None:
    """The pid of the process downloading into a cache file named ``name``; None: not a download's.

    Example::

        assert part_owner(".shard-000.bin.part-4242-1") == 4242 and part_owner("shard-000.bin") is None
    """
    match = _PART.match(name)
    return None if match is None else int(match.group(1))


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (as far as this process can tell): not when it has exited, even before
    its parent reaps it (a zombie, which signals still reach, writes no more).

    Example::

        assert alive(os.getpid())
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError, IndexError):  # Linux: the state follows the command name's ")"
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return True


class RoomWatch:
    """One reservation's wait (see the module docstring): call :meth:`check` between tries.

    Args:
        directory: the cache's directory.
        key: the entry waited for (named in the log).
        limit: the cache's ``cache_limit`` (None: none).
        stall_s: seconds without change, needed and with no download in progress, before
            :class:`CacheStalledError`.
        wait_s: seconds needed before :class:`CacheFullError`.
        needed: whether a batch needs the entry now; None: always.
    """

    def __init__(
        self, directory: Path, key: str, limit: int | None, stall_s: float, wait_s: float,
        needed: Callable[[], bool] | None = None,
    ) -> None:  # fmt: skip
        self.directory, self.key, self.limit = directory, key, limit
        self.stall_s, self.wait_s, self.needed = stall_s, wait_s, needed
        self._since: float | None = None  # when the entry became needed
        self._changed = self._next_scan = self._next_log = 0.0
        self._fingerprint: int | None = None
        self._used, self._downloading = 0, False

    def check(self, size: int, extra: int = 0) -> None:
        """Log or raise as the wait so far calls for (``size``: bytes of the entry's file, ``extra``: of
        what it keeps beside it; the cache admits it once what is cached plus ``extra`` fits the limit)."""
        if self.needed is not None and not self.needed():
            self._since = None
            return
        now = time.monotonic()
        if self._since is None:
            self._since = self._changed = now
            self._next_log, self._next_scan = now + min(_LOG_EVERY_S, self.stall_s / 2), now
        if now >= self._next_scan:
            used, fingerprint, downloading = _scan(self.directory)
            if downloading or fingerprint != self._fingerprint:
                self._fingerprint, self._changed = fingerprint, now
            self._used, self._downloading = used, downloading
            self._next_scan = now + min(_SCAN_EVERY_S, self.stall_s / 4)
        limit = -1 if self.limit is None else self.limit
        if now - self._changed >= self.stall_s and not self._downloading:
            raise CacheStalledError(str(self.directory), limit, self._used, size, now - self._changed, extra)
        if now - self._since >= self.wait_s and not self._downloading:  # a download is bounded by its retries
            raise CacheFullError(str(self.directory), limit, self._used, size, "", self._used + extra)
        if now >= self._next_log:
            self._next_log = now + _LOG_EVERY_S
            _log.warning(
                "%s: a batch has waited %.0f s for %s (%d bytes): %d bytes cached (cache_limit %s), %s",
                self.directory, now - self._since, self.key, size, self._used, self.limit,
                "a download in progress" if self._downloading else f"every entry pinned, nothing changed for "
                f"{now - self._changed:.0f} s (stalled at {self.stall_s:.0f} s)",
            )  # fmt: skip
