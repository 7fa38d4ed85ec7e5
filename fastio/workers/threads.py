"""Worker threads making batches ahead of the consumer: the native gather releases the GIL, so threads are
the fast path for shards and tar members. Batches land in the producer's reused buffers
(:class:`fastio.sources.BufferPool`: a set is refilled only when nothing outside still views it).

Batch ``j`` is handed out only in order, at most ``slots`` batches in flight; an exception in a worker is
re-raised in the consumer. ``unit > 1``: a worker takes ``unit`` consecutive batches at once and makes them
one after the other (packing's groups: the first fills a buffer, the rest are views of it), up to one unit
per worker in flight, so that batches far cheaper than a thread switch are not handed over one switch each;
a waiting side is woken only when it has something to do. Worker threads still running at interpreter exit
are stopped and joined first (a daemon thread caught inside the native gather by the shutdown would abort
the process).

Example::

    pipeline = ThreadPipeline(produce, n_batches=100, num_workers=2, slots=4)
    ok, (batch, size) = pipeline.get(0)
    pipeline.stop()
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from fastio.errors import WorkerTimeoutError

__all__ = ["ThreadPipeline"]

_EXIT_WAIT_S = 10.0  # at interpreter exit, how long worker threads may take to finish their batch


_running_thread_pipelines: weakref.WeakSet[ThreadPipeline] = weakref.WeakSet()


@atexit.register
def _stop_thread_pipelines() -> None:
    """Let worker threads finish their batch before the interpreter shuts down: a daemon thread still inside
    the native gather then would be unwound through C++ frames that cannot be, and the process aborts."""
    pipelines = list(_running_thread_pipelines)
    for pipeline in pipelines:
        pipeline.stop()
    deadline = time.monotonic() + _EXIT_WAIT_S
    for pipeline in pipelines:
        for thread in pipeline.threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))


class ThreadPipeline:
    """Worker threads running ``produce(job)`` ahead of the consumer (see the module docstring).

    ``worker_init(worker_id)``, when given, runs first in each thread. ``timeout > 0``: :meth:`get` gives
    :class:`fastio.errors.WorkerTimeoutError` when a batch takes longer than that many seconds.
    ``persistent=True`` (DataLoader's ``persistent_workers``): the threads outlive the pass and serve the
    next one (:meth:`next_pass`), ``worker_init`` having run once. ``unit``: batches a worker takes at once.

    Example::

        pipeline = ThreadPipeline(lambda j: (j, 1), n_batches=3, num_workers=2, slots=2)
        assert pipeline.get(0) == (True, (0, 1))
    """

    def __init__(
        self,
        produce: Callable[[int], Any],
        n_batches: int,
        num_workers: int,
        slots: int,
        worker_init: Callable[[int], None] | None = None,
        timeout: float = 0.0,
        persistent: bool = False,
        unit: int = 1,
    ) -> None:
        self.produce, self.n_batches, self.slots, self.timeout = produce, n_batches, slots, timeout
        self.unit = max(1, unit)
        self.ahead = slots if self.unit == 1 else max(slots, self.unit * num_workers)  # batches in flight
        self.idle_workers = 0
        self.consumer_waits = False
        self.worker_init, self.persistent = worker_init, persistent
        self.pass_init: Callable[[int], None] | None = None
        self.generation = 0  # passes served before this one: a batch of an earlier pass is dropped
        self.cond = threading.Condition()
        self.next_job = 0
        self.released = 0
        self.results: dict[int, tuple[bool, Any]] = {}
        self.stopped = False
        self.threads = [
            threading.Thread(target=self._work, args=(w,), name=f"fastio-worker-{w}", daemon=True)
            for w in range(num_workers)
        ]
        for t in self.threads:
            t.start()
        _running_thread_pipelines.add(self)

    def _idle(self) -> bool:
        return self.next_job >= self.n_batches or self.next_job >= self.released + self.ahead

    def _work(self, worker_id: int) -> None:
        if self.worker_init is not None:
            self.worker_init(worker_id)
        served = 0
        while True:
            with self.cond:
                while (
                    not self.stopped and self._idle() and (self.persistent or self.next_job < self.n_batches)
                ):
                    self.idle_workers += 1
                    self.cond.wait()
                    self.idle_workers -= 1
                if self.stopped or self.next_job >= self.n_batches:
                    return
                first, generation, produce, pass_init = (
                    self.next_job,
                    self.generation,
                    self.produce,
                    self.pass_init,
                )
                stop = self.next_job = min(first + self.unit, self.n_batches)
            if served != generation and pass_init is not None:
                pass_init(worker_id)
            served = generation
            for job in range(first, stop):
                try:
                    result = (True, produce(job))
                except BaseException as exc:  # handed to the consumer, which re-raises it
                    result = (False, exc)
                with self.cond:
                    if generation != self.generation or self.stopped:
                        break
                    self.results[job] = result
                    if self.consumer_waits:  # an idle worker waits on the consumer's release, not on results
                        self.cond.notify_all()
                if not result[0]:
                    break

    def next_pass(self, update: Any, n_batches: int, times: Any) -> bool:
        """Serve another pass with the same threads (``persistent=True``): ``update = (produce, pass_init)``,
        the new pass's producer and what each thread runs before its first batch of it. False when a thread
        is gone (build a new pipeline then). ``times`` is the new producer's own: unused here.

        Example::

            pipeline.next_pass((producer, producer.start_worker), n_batches=10, times=producer.times)
        """
        with self.cond:
            if self.stopped or not all(t.is_alive() for t in self.threads):
                return False
            self.produce, self.pass_init = update
            self.n_batches, self.next_job, self.released, self.results = n_batches, 0, 0, {}
            self.generation += 1
            self.cond.notify_all()
        return True

    def get(self, job: int) -> tuple[bool, Any]:
        """``(True, produce(job))`` or ``(False, exception)``; blocks until batch ``job`` is made."""
        return self._wait(job, ready=False)[1:]

    def get_ready(self, first: int) -> tuple[int, bool, Any]:
        """``(job, ok, value)`` of whichever batch from ``first`` on (the first not yet handed out) is made
        first (DataLoader's ``in_order=False``); at most ``slots`` batches from ``first`` are in flight."""
        return self._wait(first, ready=True)

    def _wait(self, job: int, ready: bool) -> tuple[int, bool, Any]:
        with self.cond:
            self.released = job  # the consumer moved past job - 1: another batch may start
            if self.idle_workers and not self._idle():
                self.cond.notify_all()
            deadline = time.monotonic() + self.timeout if self.timeout > 0 else None
            while not (self.results if ready else job in self.results):
                if not any(t.is_alive() for t in self.threads):
                    return job, False, RuntimeError(f"fastio: worker threads exited before batch {job}")
                if deadline is not None and time.monotonic() >= deadline:
                    return (
                        job,
                        False,
                        WorkerTimeoutError(f"fastio: batch {job} not made within timeout={self.timeout} s"),
                    )
                self.consumer_waits = True
                self.cond.wait(timeout=1.0 if deadline is None else min(1.0, deadline - time.monotonic()))
                self.consumer_waits = False
            job = min(self.results) if ready else job
            return (job, *self.results.pop(job))

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()
