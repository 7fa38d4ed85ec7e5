"""Work that runs off the caller's thread, and a clean interpreter exit while any of it is about.

Two kinds of it:

* Callbacks on collective futures (:func:`then`, :func:`when_done`). torch runs a future's Python
  callback on the thread that completes the future (a gloo worker, or one of our own threads) and drops it
  there afterwards, taking the GIL again to do so, *after* the futures waiting on it have been released.
  A script whose last backward returns can reach interpreter finalization inside that window; the callback's
  thread then asks for the GIL of a finalizing interpreter, Python ends it with ``pthread_exit``, and the
  unwind through torch's C++ destructor calls ``std::terminate``: "terminate called without an active
  exception", SIGABRT, after the last step.
* :class:`OrderedWorker` threads (the phase-2 lanes, the hierarchical groups' workers), each running jobs in
  submission order; a job may be inside a collective.

:func:`quiesce` runs at interpreter exit (``atexit``, before finalization starts): it stops every worker
after the jobs it was given and waits until every callback handed to a future has been dropped (run, or its
future freed). Both waits release the GIL and are bounded, so a collective that never completes can delay
exit by seconds, never hang it.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["OrderedWorker", "callbacks_in_flight", "quiesce", "then", "wait_for_callbacks", "when_done"]

_log = logging.getLogger(__name__)
_T = TypeVar("_T")

# How long exit waits for started callbacks to be dropped, and for each worker to finish its jobs.
EXIT_WAIT_S = 10.0
# How long exit then leaves the GIL to the threads that completed collectives, to finish with them.
_SETTLE_S = 0.2


class _InFlight:
    """The callbacks handed to a future and not dropped yet."""

    def __init__(self) -> None:
        self.changed = threading.Condition()  # over an RLock: a weakref callback may run inside add()
        self.count = 0
        self.refs: set[weakref.ref] = set()

    def add(self, delta: int) -> None:
        with self.changed:
            self.count += delta
            if self.count == 0:
                self.changed.notify_all()

    ever = False  # whether this process handed any callback to a future

    def track(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` in a wrapper that counts until the future that runs it drops it.

        The wrapper is a ``functools.partial``, called from C with no Python frame of its own: a traceback
        that keeps ``fn``'s frames alive (an error stored in a future) cannot keep the wrapper alive, so it
        is dropped, and uncounted, when torch drops it.
        """
        wrapper = functools.partial(fn)
        self.ever = True
        self.add(1)
        self.refs.add(weakref.ref(wrapper, self._dropped))
        return wrapper

    def _dropped(self, ref: weakref.ref) -> None:
        self.refs.discard(ref)
        self.add(-1)

    def wait_empty(self, timeout: float) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: self.count == 0, timeout=timeout)


_IN_FLIGHT = _InFlight()


def then(future: torch.futures.Future, fn: Callable[[torch.futures.Future], _T]) -> torch.futures.Future[_T]:
    """``future.then(fn)``, with ``fn`` waited for at interpreter exit (see the module docstring).

    Example::

        done = then(work.get_future(), lambda f: f.value()[0] / world_size)
    """
    return future.then(_IN_FLIGHT.track(fn))


def when_done(future: torch.futures.Future, fn: Callable[[torch.futures.Future], None]) -> None:
    """``future.add_done_callback(fn)``, with ``fn`` waited for at interpreter exit."""
    future.add_done_callback(_IN_FLIGHT.track(fn))


def callbacks_in_flight() -> int:
    """How many callbacks given to :func:`then` or :func:`when_done` are not dropped yet."""
    return _IN_FLIGHT.count


def wait_for_callbacks(timeout: float) -> bool:
    """Wait, the GIL released, until no callback is in flight; ``True`` if none was left by ``timeout`` s."""
    return _IN_FLIGHT.wait_empty(timeout)


class OrderedWorker:
    """A thread that runs jobs in submission order; the only thread issuing collectives on its group.

    Example::

        worker = OrderedWorker("fastcomm-phase2")
        worker.submit(lambda: dist.all_gather_into_tensor(out, row, group=group))
    """

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        _WORKERS.add(self)

    def submit(self, job: Callable[[], None]) -> None:
        """Run ``job`` after every job submitted before it; ``job`` reports its own failures."""
        self._jobs.put(job)

    def stop(self, timeout: float) -> bool:
        """End the thread after the jobs already submitted; ``True`` if it ended within ``timeout`` s."""
        self._jobs.put(None)
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            job()


_WORKERS: weakref.WeakSet[OrderedWorker] = weakref.WeakSet()


def quiesce(timeout: float = EXIT_WAIT_S) -> bool:
    """Stop every :class:`OrderedWorker` and wait for started callbacks to be dropped; ``True`` if all did.

    Registered with ``atexit``; safe to call more than once (a stopped worker is not started again, so call
    it only when no hook will run any more).
    """
    deadline = time.monotonic() + timeout
    clean = True
    for worker in list(_WORKERS):
        if not worker.stop(max(0.0, deadline - time.monotonic())):
            clean = False
            _log.warning("fastcomm: %s still running a job at exit", worker._thread.name)
    if not wait_for_callbacks(max(0.0, deadline - time.monotonic())):
        clean = False
        _log.warning("fastcomm: %d collective callbacks still running at exit", _IN_FLIGHT.count)
    if _IN_FLIGHT.ever:
        # a gloo worker drops its finished work (and the tensors in it, whose Python objects may need the
        # GIL) after our callback: give it the GIL for a moment before finalization can start
        time.sleep(_SETTLE_S)
    return clean


def _forget_in_child() -> None:
    # a forked child has none of its parent's threads: nothing of theirs will ever finish there
    global _IN_FLIGHT, _WORKERS
    _IN_FLIGHT = _InFlight()
    _WORKERS = weakref.WeakSet()


os.register_at_fork(after_in_child=_forget_in_child)
atexit.register(quiesce)
