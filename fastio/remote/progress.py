"""How far a remote pass got, shared by the planning process, its threads and its forked worker processes:
samples served per shard, the I/O counters, and three positions in the pass's first-read order of shards.

1. ``read_front``: the furthest shard a finished fetch read (the prefetcher stays ``ahead`` of it).
2. ``demand_front``: the furthest shard a fetch has asked for (a reservation at or before it is needed now).
3. ``reserved_front``: the prefetcher's (every shard before it has its room in the cache): fetches wait for
   it, so room is taken in read order only.

Example::

    progress = SharedProgress(num_shards=10)
    progress.add_consumed(np.array([3]), np.array([8.0]), front=0)
    assert progress.front("read_front") == 0
"""

from __future__ import annotations

import mmap
import os
import threading

import numpy as np

from fastio.workers.info import worker_info

__all__ = ["COUNTERS", "SharedProgress"]

_ROWS = 33  # row 0: the process that planned the pass; 1..32: worker processes (by worker id)
COUNTERS = (
    "network_wait_s", "downloaded_bytes", "downloads", "retries",
    "read_front", "demand_front", "reserved_front",
)  # fmt: skip


class SharedProgress:
    """Samples consumed per shard and the counters, per process, in anonymous shared memory made before the
    fork: row 0 is the planning process (its threads add under a lock), row ``1 + worker id`` a worker
    process. Sums (or maxima, for the fronts) over rows are what everyone read."""

    def __init__(self, num_shards: int) -> None:
        width = num_shards + len(COUNTERS)
        self._map = mmap.mmap(-1, max(1, _ROWS * width * 8))
        table = np.frombuffer(self._map, dtype=np.float64).reshape(_ROWS, width)
        self.consumed, self.counters = table[:, :num_shards], table[:, num_shards:]
        self.lock = threading.Lock()
        self.owner = os.getpid()

    def row(self) -> int:
        if os.getpid() == self.owner:
            return 0
        info = worker_info()
        return 1 + (info.id % (_ROWS - 1) if info is not None else 0)

    def add_consumed(self, shards: np.ndarray, counts: np.ndarray, front: int) -> None:
        """Count samples served from ``shards``; ``front``: the furthest read-order position among them."""
        with self.lock:
            self.consumed[self.row(), shards] += counts
            self._advance("read_front", front)

    def advance(self, front: str, position: int) -> None:
        """Move this process's ``front`` up to read-order ``position`` (never back)."""
        with self.lock:
            self._advance(front, position)

    def _advance(self, front: str, position: int) -> None:
        row, column = self.row(), COUNTERS.index(front)
        self.counters[row, column] = max(self.counters[row, column], position + 1)  # stored + 1: 0 is none

    def front(self, front: str) -> int:
        """The furthest read-order position any process's ``front`` reached (-1: none)."""
        return int(self.counters[:, COUNTERS.index(front)].max()) - 1

    def demanded(self, position: int) -> bool:
        """Whether a fetch has asked for the shard at read-order ``position`` (or one read after it)."""
        return position <= self.front("demand_front")

    def add(self, counter: str, value: float) -> None:
        row = self.row()
        with self.lock:
            self.counters[row, COUNTERS.index(counter)] += value

    def finished(self, expected: np.ndarray | None, shards: np.ndarray | None = None) -> np.ndarray:
        """Which shards have had all the samples ``expected`` of them (per shard) served this pass (of
        ``shards`` only, when given: the others read False); none when ``expected`` is unknown."""
        done = np.zeros(self.consumed.shape[1], dtype=bool)
        if expected is None:
            return done
        if shards is None:
            done[:] = (expected > 0) & (self.consumed.sum(axis=0) >= expected)
        else:
            done[shards] = (expected[shards] > 0) & (self.consumed[:, shards].sum(axis=0) >= expected[shards])
        return done

    def totals(self) -> dict[str, float]:
        sums = self.counters.sum(axis=0)
        return {name: float(v) for name, v in zip(COUNTERS, sums, strict=True)}
