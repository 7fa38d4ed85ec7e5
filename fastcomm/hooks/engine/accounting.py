"""Step accounting and traffic statistics of one hook state, and the counters its checkpoint keeps.

DDP calls a hook once per bucket, bucket 0 first. :class:`StepAccounting` turns that stream into
iterations: one opens at bucket 0 and closes when the next opens (or when a reader asks). A hook's output
is identical on every rank, so whether it held inf/NaN is a decision all ranks agree on without another
collective: such an iteration is a skipped step (GradScaler skips it), any other a step.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from fastcomm.collectives.traffic import Traffic

__all__ = ["COUNTERS", "NodeTraffic", "ShardAccounting", "StepAccounting", "StepTimes"]

# the counters a checkpoint keeps, with their types (``bytes_sent`` is the traffic's ``sent_bytes``, under
# the name checkpoints have always used)
COUNTERS: dict[str, type] = {
    "steps": int,
    "skipped_steps": int,
    "bytes_sent": int,
    "dense_bytes": int,
    "compress_seconds": float,
    "compressed_buckets": int,
    "dense_buckets": int,
}
# the counters of COUNTERS that the traffic holds
_TRAFFIC = ("bytes_sent", "dense_bytes")


class StepTimes:
    """Where a step's time goes, measured in place: the iteration period and the communication it shows.

    Per iteration (bucket 0's hook call to the next one's), from the clock of this rank's hook calls and
    results, not from assumptions:

    * ``step_seconds``: the time between two iterations' first hook calls (forward, backward, optimizer).
    * ``exposed_comm_seconds``: from the last bucket's hook call (its gradient is the backward's last) to
      the last bucket result's decode: what the optimizer step waits for after the backward.
    * ``comm_window_seconds``: from the first hook call to the last result: the backward's communication.
    * ``link_bytes_per_second``: the bytes this rank sent in those windows over their length (a lower
      bound of the link's rate: the window also holds compression and backward compute).

    The timed iterations are the ones with at least one result; counts start at construction.
    """

    def __init__(self) -> None:
        self.first_call = self.last_call = self.last_done = self.last_open = None
        self.bytes = 0
        self.totals = {"timed_steps": 0, "periods": 0, "step": 0.0, "exposed": 0.0, "window": 0.0, "bytes": 0}

    def open(self, now: float) -> None:
        if self.last_open is not None:
            self.totals["periods"] += 1
            self.totals["step"] += now - self.last_open
        self.last_open = self.first_call = self.last_call = now
        self.last_done, self.bytes = None, 0

    def close(self) -> None:
        if self.first_call is None or self.last_done is None or self.last_call is None:
            return
        self.totals["timed_steps"] += 1
        self.totals["exposed"] += max(0.0, self.last_done - self.last_call)
        self.totals["window"] += max(0.0, self.last_done - self.first_call)
        self.totals["bytes"] += self.bytes
        self.first_call = None

    def stats(self) -> dict[str, float]:
        totals = self.totals
        timed, periods = max(1, totals["timed_steps"]), totals["periods"]
        step = totals["step"] / periods if periods else 0.0
        exposed = totals["exposed"] / timed
        return {
            "step_seconds": step,
            "exposed_comm_seconds": exposed,
            "comm_share": min(1.0, exposed / step) if step > 0 else 0.0,
            "comm_window_seconds": totals["window"] / timed,
            "link_bytes_per_second": totals["bytes"] / totals["window"] if totals["window"] > 0 else 0.0,
        }


class StepAccounting:
    """Iterations, steps, skipped steps and traffic counters (safe to update from any thread).

    Counters are updated from DDP's hook thread, gloo's callback threads and the phase-2 thread; the
    iteration itself is opened and closed from the hook thread only.

    Example::

        accounting = StepAccounting()
        accounting.open_iteration()
        accounting.count(bytes_sent=100, dense_bytes=400, seconds=0.001, compressed=True)
        accounting.close_iteration()  # True: a finite step was counted
        print(accounting.stats()["sent_bytes"], accounting.stats()["compression_ratio"])  # 100 4.0
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # the bytes, counted as every mode counts them; the other counters here
        self.traffic = Traffic()
        self._counters: dict[str, int | float] = {
            name: kind() for name, kind in COUNTERS.items() if name not in _TRAFFIC
        }
        self.iterations_seen = 0
        self._open = False
        self._nonfinite = False
        self.times = StepTimes()

    @property
    def steps(self) -> int:
        """Iterations closed with finite outputs (the open one is not counted yet)."""
        return int(self._counters["steps"])

    @property
    def is_open(self) -> bool:
        """Whether an iteration is open (its bucket 0 was seen and the next iteration has not started)."""
        return self._open

    def open_iteration(self) -> None:
        """Start an iteration (the previous one must be closed)."""
        with self._lock:
            self.times.open(time.perf_counter())
        self._open = True
        self._nonfinite = False
        self.iterations_seen += 1

    def close_iteration(self) -> bool | None:
        """Close the open iteration: ``True`` for a step, ``False`` if skipped, ``None`` if none was open."""
        if not self._open:
            return None
        finite = not self._nonfinite
        with self._lock:
            self._counters["steps" if finite else "skipped_steps"] += 1
            self.times.close()
        self._open = False
        self._nonfinite = False
        return finite

    def note_call(self) -> None:
        """A hook call of the open iteration began (its bucket's gradient is ready)."""
        with self._lock:
            self.times.last_call = time.perf_counter()

    def note_output(self, finite: bool) -> None:
        """Record whether a bucket's (rank-identical) result was finite, and when it was ready."""
        with self._lock:
            self.times.last_done = time.perf_counter()
        if not finite:
            self._nonfinite = True

    def count(self, bytes_sent: int, dense_bytes: int, seconds: float, compressed: bool) -> None:
        """Add one hook call's traffic, its dense equivalent and its compression time."""
        with self._lock:
            self.traffic.add(bytes_sent, dense_bytes)
            self.times.bytes += bytes_sent
            self._counters["compress_seconds"] += seconds
            self._counters["compressed_buckets" if compressed else "dense_buckets"] += 1

    def add_seconds(self, seconds: float) -> None:
        """Add compression time measured on another thread (a collective's callback)."""
        with self._lock:
            self._counters["compress_seconds"] += seconds

    def stats(self) -> dict[str, float | int]:
        """The counters, the traffic as every mode reports it (:meth:`~fastcomm.collectives.Traffic.stats`:
        ``sent_bytes``, ``dense_bytes``, ``compression_ratio``), ``bytes_sent`` (the same number as
        ``sent_bytes``, under the name earlier releases reported) and :class:`StepTimes`' figures."""
        with self._lock:
            counters: dict[str, float | int] = dict(self._counters)
            traffic = self.traffic.stats()
            counters.update(self.times.stats())
        ordered = {"steps": counters["steps"], "skipped_steps": counters["skipped_steps"], **traffic}
        ordered["bytes_sent"] = traffic["sent_bytes"]
        ordered.update(counters)
        return ordered

    def state_dict(self) -> dict[str, Any]:
        """The counters :data:`COUNTERS` names, as plain Python values."""
        with self._lock:
            traffic = {"bytes_sent": self.traffic.sent_bytes, "dense_bytes": self.traffic.dense_bytes}
            return {name: traffic[name] if name in _TRAFFIC else self._counters[name] for name in COUNTERS}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the counters :meth:`state_dict` returned."""
        with self._lock:
            for name, kind in COUNTERS.items():
                if name not in _TRAFFIC:
                    self._counters[name] = kind(state_dict[name])
            calls = self._counters["compressed_buckets"] + self._counters["dense_buckets"]
            self.traffic.load_state_dict({**state_dict, "calls": calls})


class NodeTraffic:
    """Bytes this rank sent inside its node and to other nodes (thread-safe; checkpointed)."""

    NAMES = ("intra_node_bytes", "cross_node_bytes")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counters = dict.fromkeys(self.NAMES, 0)

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, value in counts.items():
                self.counters[name] += value

    def load(self, counters: dict[str, int]) -> None:
        with self._lock:
            self.counters = {name: int(counters.get(name, 0)) for name in self.NAMES}


class ShardAccounting:
    """The step accounting the shard exchange writes to: the state's own, plus cross-node byte counts."""

    def __init__(self, outer: StepAccounting, traffic: NodeTraffic) -> None:
        self._outer, self._traffic = outer, traffic

    @property
    def steps(self) -> int:
        return self._outer.steps

    def count(self, bytes_sent: int, dense_bytes: int, seconds: float, compressed: bool) -> None:
        self._traffic.add(cross_node_bytes=bytes_sent)
        self._outer.count(bytes_sent, dense_bytes, seconds, compressed)

    def add_seconds(self, seconds: float) -> None:
        self._outer.add_seconds(seconds)

    def note_output(self, finite: bool) -> None:
        self._outer.note_output(finite)
