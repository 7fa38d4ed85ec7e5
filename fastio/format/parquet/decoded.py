"""The decoded row groups a Parquet source keeps in memory (:class:`DecodedRowGroups`): a row group is
decoded once, by one thread, while others that need it wait for that decode; the least recently used are
dropped past a byte budget. Batches cut from a decoded row group copy out of it (fixed columns into the
loader's buffers), so dropping one never changes a batch already made. :meth:`DecodedRowGroups.prefetch`
starts a decode on a background thread (pyarrow decodes without the GIL): the row groups a batch will need
next, or all those one batch needs at once, decode side by side while the loader cuts batches.

Example::

    decoded = DecodedRowGroups(limit=1 << 30)
    columns = decoded.get(("a.parquet", 0), lambda: read_and_decode(0))
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np
import pyarrow as pa

__all__ = ["DEFAULT_MEMORY", "DecodedRowGroups", "decoded_size"]

DEFAULT_MEMORY = 2 << 30  # bytes of decoded row groups a source keeps, by default
_DECODE_THREADS = min(4, os.cpu_count() or 1)  # background decodes at once
_CACHES: weakref.WeakSet[DecodedRowGroups] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for cache in list(_CACHES):
        cache.reset_after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


def decoded_size(columns: dict[str, Any]) -> int:
    """Bytes a decoded row group holds (numpy arrays, Arrow arrays, tuples of them).

    Example::

        decoded_size({"y": np.zeros(10, np.int64)})   # 80
    """
    total = 0
    for value in columns.values():
        for part in value if isinstance(value, tuple) else (value,):
            if isinstance(part, np.ndarray):
                total += part.nbytes
            elif isinstance(part, (pa.Array, pa.ChunkedArray)):
                total += part.nbytes
    return total


class DecodedRowGroups:
    """Decoded row groups by key, at most ``limit`` bytes of them (the last one decoded is kept even when it
    alone is larger). Thread-safe; a forked process starts with the parent's entries and fresh locks.

    Example::

        decoded = DecodedRowGroups(limit=1 << 30)
        columns = decoded.get(key, decode)
    """

    def __init__(self, limit: int = DEFAULT_MEMORY) -> None:
        if limit < 0:
            raise ValueError(f"limit must be >= 0 bytes, got {limit}")
        self.limit = limit
        self.decodes = 0  # row groups decoded by this process (a statistic)
        self._entries: OrderedDict[Hashable, tuple[dict[str, Any], int]] = OrderedDict()
        self._pending: dict[Hashable, concurrent.futures.Future[dict[str, Any]]] = {}
        self._bytes = 0
        self._lock = threading.Lock()
        self._threads: concurrent.futures.ThreadPoolExecutor | None = None
        _CACHES.add(self)

    def reset_after_fork(self) -> None:
        """Fresh locks, no pending decodes and no decode threads (those ran in the parent)."""
        self._lock = threading.Lock()
        self._pending = {}
        self._threads = None

    def prefetch(self, key: Hashable, decode: Callable[[], dict[str, Any]]) -> None:
        """Start decoding ``key`` on a background thread, unless it is kept or being decoded. A failure is
        left for the :meth:`get` that needs the row group (it decodes again and raises).

        Example::

            decoded.prefetch(("a.parquet", 4), lambda: decode_row_group(4))
        """
        with self._lock:
            if key in self._entries or key in self._pending:
                return
            if self._threads is None:
                self._threads = concurrent.futures.ThreadPoolExecutor(
                    _DECODE_THREADS, thread_name_prefix="fastio-parquet-decode"
                )
            threads = self._threads
        threads.submit(self._decode_quietly, key, decode)

    def _decode_quietly(self, key: Hashable, decode: Callable[[], dict[str, Any]]) -> None:
        with contextlib.suppress(Exception):
            self.get(key, decode)

    def get(self, key: Hashable, decode: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """The decoded row group ``key``: kept, being decoded by another thread (waited for), or decoded
        here by ``decode()``.

        Example::

            columns = decoded.get(("a.parquet", 3), lambda: decode_row_group(3))
        """
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                return entry[0]
            pending = self._pending.get(key)
            mine = pending is None
            if mine:
                pending = self._pending[key] = concurrent.futures.Future()
        if not mine:
            return pending.result()
        try:
            columns = decode()
        except BaseException as exc:
            with self._lock:
                del self._pending[key]
            pending.set_exception(exc)
            raise
        size = decoded_size(columns)
        with self._lock:
            del self._pending[key]
            self._entries[key] = (columns, size)
            self._bytes += size
            self.decodes += 1
            while self._bytes > self.limit and len(self._entries) > 1:
                _, (_, dropped) = self._entries.popitem(last=False)
                self._bytes -= dropped
        pending.set_result(columns)
        return columns

    def clear(self) -> None:
        """Drop every kept row group."""
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    @property
    def bytes(self) -> int:
        """Bytes of decoded row groups kept now."""
        return self._bytes
