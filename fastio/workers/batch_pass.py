"""The consumer's side of one pass: batch ``j`` taken in order from a worker pipeline (or made in place),
counted, and reported as the loader's throughput stats.

Example::

    batch, size = epoch.take(); epoch.count(size)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from fastio.workers.kept import KeptWorkers
from fastio.workers.processes import ProcessPipeline
from fastio.workers.threads import ThreadPipeline

__all__ = ["BatchPass"]


class BatchPass:
    """The consumer's side of one pass over ``n_batches`` batches: batch ``j`` comes from ``pipeline`` (made
    ahead by workers) or, without one, is made here by ``producer``; an error of the producer closes the
    pass and is raised here. Counts batches, samples and the time spent waiting; :meth:`stats` is
    the throughput report of :meth:`fastio.StreamLoader.stats`.

    Subclasses set ``epoch``, ``start`` (the epoch's units before the pass: samples of its order, or
    packed rows), ``times`` (a :class:`fastio.sources.StageTimes`), ``producer`` and ``pipeline`` (and
    ``kept``, with persistent workers: then a kept pipeline is left running at the pass's end) and call
    :meth:`begin_pass`; their ``__next__`` is ``batch, size = self.take()``, then whatever they do to the
    batch, then ``self.count(size)``.

    Example::

        class Numbers(BatchPass):
            def __init__(self):
                self.epoch, self.times, self.pipeline = 0, StageTimes(), None
                self.producer = lambda j: (j, 1)
                self.begin_pass(3)
            def __next__(self):
                batch, size = self.take(); self.count(size); return batch
        assert list(Numbers()) == [0, 1, 2]
    """

    epoch: int
    start: int
    times: Any
    producer: Callable[[int], Any]
    pipeline: ThreadPipeline | ProcessPipeline | None
    in_order: bool = True  # False: a pipeline hands out whichever batch in flight is ready first
    kept: KeptWorkers | None = None  # persistent workers: their pipeline outlives the pass

    def begin_pass(self, n_batches: int, numbers: list[int] | None = None) -> None:
        """A pass of ``n_batches`` batches; ``numbers[j]``: batch ``j``'s number counted from the pass's start
        (default ``j``); the numbers missing from it were handed over before (a resume after batches came out
        of order) and count as done."""
        self.n_batches = n_batches
        self.numbers = list(range(n_batches)) if numbers is None else numbers
        last = self.numbers[-1] + 1 if self.numbers else 0
        self.done = set(range(last)) - set(self.numbers)
        self.first = 0  # the first job not handed over yet
        self.handed: set[int] = set()
        self.yielded = self.samples = 0
        self.wait_s = 0.0
        self.begun: float | None = None
        self.ended: float | None = None
        self.finished = False

    def __iter__(self) -> BatchPass:
        return self

    def take(self) -> Any:
        """The next batch as the producer returned it; ``StopIteration`` after the last."""
        if self.begun is None:
            self.begun = time.perf_counter()
        if self.yielded >= self.n_batches:
            self.close()
            raise StopIteration
        waited = time.perf_counter()
        try:
            if self.pipeline is None:
                job, ok, value = self.first, True, self.producer(self.first)
            elif self.in_order:
                job, (ok, value) = self.first, self.pipeline.get(self.first)
            else:
                job, ok, value = self.pipeline.get_ready(self.first)
            if not ok:
                raise value
            self.handed.add(job)
            self.done.add(self.numbers[job])
            while self.first in self.handed:
                self.first += 1
            return value
        except BaseException:
            self.close()
            raise
        finally:
            self.wait_s += time.perf_counter() - waited

    def count(self, size: int) -> None:
        """Batch handed over: ``size`` samples (rows) more."""
        self.yielded += 1
        self.samples += size
        self.ended = time.perf_counter()

    def position(self) -> tuple[int, list[int]]:
        """``(batches, ahead)``: the batches from the pass's start all handed over, and the numbers of those
        handed over beyond them (out of order, ``in_order=False``), counted from the pass's start.

        Example::

            batches, ahead = epoch.position()   # (3, [5]): 0, 1, 2 and 5 were handed over
        """
        batches = 0
        while batches in self.done:
            batches += 1
        return batches, sorted(n for n in self.done if n > batches)

    def close(self) -> None:
        if self.finished:
            return
        self.finished = True
        self.ended = time.perf_counter() if self.begun is not None else None
        if self.kept is not None and self.pipeline is self.kept.pipeline:
            self.pipeline = None  # its workers serve the next pass (persistent_workers=True)
        if self.pipeline is not None:
            self.pipeline.stop()

    def __del__(self) -> None:
        pipeline = getattr(self, "pipeline", None)
        if pipeline is not None and (self.kept is None or pipeline is not self.kept.pipeline):
            pipeline.stop()

    def stats(self) -> dict[str, Any]:
        elapsed = (self.ended or time.perf_counter()) - self.begun if self.begun is not None else 0.0
        return {
            "epoch": self.epoch,
            "batches": self.yielded,
            "samples": self.samples,
            "elapsed_s": elapsed,
            "samples_per_s": self.samples / elapsed if elapsed > 0 else 0.0,
            "mb_per_s": self.times.bytes / elapsed / 1e6 if elapsed > 0 else 0.0,
            "stage_s": dict(self.times.seconds),
            "wait_s": self.wait_s,
            "wait_share": self.wait_s / elapsed if elapsed > 0 else 0.0,
            "input_bound": elapsed > 0 and self.wait_s / elapsed >= 0.5,
        }
