"""An entry of :class:`fastio.remote.cache.ShardCache` being made (:meth:`ShardCache.reserve`): its temporary
file, the placeholder of what is kept beside it, its download lock; renamed into place once verified."""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
from collections.abc import Callable
from pathlib import Path

from fastio.errors import CorruptShardError
from fastio.remote.locks import close_lock, flock

__all__ = ["Reservation"]


class Reservation:
    """An entry being made: its temporary file ``part`` (written by the caller from byte 0) and the
    placeholder ``room`` of the ``extra`` bytes its sidecars take, the entry's download lock held until
    :meth:`finish` or :meth:`abort`. Usable from another thread than the one that reserved it.

    Example::

        job = cache.reserve(key, size)
        job.part.write_bytes(data); job.finish()
    """

    def __init__(self, dest: Path, size: int | None, lock_fd: int, extra: int, cache_lock: Path) -> None:
        suffix = f"part-{os.getpid()}-{threading.get_ident()}"
        self.part = dest.with_name(f".{dest.name}.{suffix}")
        self.room = dest.with_name(f".{dest.name}.index.{suffix}")
        self.dest, self.size, self.extra, self._fd, self._cache_lock = dest, size, extra, lock_fd, cache_lock

    def finish(
        self, check: Callable[[Path], None] | None = None, beside: Callable[[Path], None] | None = None
    ) -> Path:
        """Verify the size (and ``check(part)``), rename into place and write what is kept beside the entry
        (``beside(entry path)``, a sidecar, in the room of its placeholder: at most ``extra`` bytes), both
        under the cache's lock, release the entry's lock; returns the entry's path. Raises
        :class:`fastio.CorruptShardError` for a wrong size (the temporary file is removed)."""
        try:
            actual = self.part.stat().st_size
            if self.size is not None and actual != self.size:
                raise CorruptShardError(str(self.dest), "download", f"{self.size} bytes", f"{actual} bytes")
            if check is not None:
                check(self.part)
            # Under the cache's lock: a count of its bytes never sees a file between two names (and skips
            # it), and no reservation takes the placeholder's room before the sidecar has it.
            with flock(self._cache_lock, fcntl.LOCK_EX):
                os.replace(self.part, self.dest)
                if beside is not None:
                    with contextlib.suppress(FileNotFoundError):
                        self.room.unlink()
                    beside(self.dest)
        finally:
            self.abort()
        return self.dest

    def abort(self) -> None:
        """Drop the temporary file and the placeholder, release the lock (idempotent)."""
        for path in (self.part, self.room):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        if self._fd >= 0:
            close_lock(self._fd)
            self._fd = -1
