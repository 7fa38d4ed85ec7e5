"""The workers a loader keeps from one pass to the next (DataLoader's ``persistent_workers=True``): worker
threads or worker processes, started once, ``worker_init_fn`` run once per worker, serving every epoch.

Example::

    kept = KeptWorkers()
    pipeline = kept.take(update, n_batches, times) or kept.keep(ThreadPipeline(..., persistent=True))
"""

from __future__ import annotations

import atexit
import weakref
from typing import Any

from fastio.workers.processes import ProcessPipeline
from fastio.workers.threads import ThreadPipeline

__all__ = ["KeptWorkers"]

_kept: weakref.WeakSet[KeptWorkers] = weakref.WeakSet()


@atexit.register
def _stop_kept_workers() -> None:
    """Stop kept workers while the interpreter can still talk to them (a loader alive at exit is collected
    only after the modules its pipes need are gone)."""
    for kept in list(_kept):
        kept.close()


class KeptWorkers:
    """:meth:`take` hands the kept pipeline to the next pass (its ``next_pass(update, n_batches, times)``:
    ``update`` is ``(epoch, indices, bounds)`` for processes, ``(produce, pass_init)`` for threads), or None
    when there is none yet or it can serve no more (then the pass builds one and hands it to :meth:`keep`).
    Stops it when dropped.

    Example::

        pipeline = kept.take(update, n_batches, times) or kept.keep(ProcessPipeline(...))
    """

    def __init__(self) -> None:
        self.pipeline: ThreadPipeline | ProcessPipeline | None = None
        _kept.add(self)

    def take(self, update: Any, n_batches: int, times: Any) -> ThreadPipeline | ProcessPipeline | None:
        pipeline = self.pipeline
        if pipeline is not None and not pipeline.next_pass(update, n_batches, times):
            pipeline.stop()
            pipeline = self.pipeline = None
        return pipeline

    def keep(self, pipeline: ThreadPipeline | ProcessPipeline) -> ThreadPipeline | ProcessPipeline:
        self.pipeline = pipeline
        return pipeline

    def close(self) -> None:
        """Stop the kept workers; the next pass starts new ones."""
        if self.pipeline is not None:
            self.pipeline.stop()
            self.pipeline = None

    def __del__(self) -> None:
        self.close()
