"""The two ways a :class:`fastio.StreamLoader` makes batches ahead of its consumer, and what a worker knows.

* :class:`ThreadPipeline`: threads call the producer; the native gather releases the GIL, so threads are
  the fast path for shards and tar members. Batches land in the producer's reused buffers
  (:class:`fastio.sources.BufferPool`: a set is refilled only when nothing outside still views it).
* :class:`ProcessPipeline`: forked processes call the producer (for Python transforms, collates and
  Datasets that hold the GIL). Each process writes the tensors of its batch into a ring slot: a file in
  ``$FASTIO_WORKER_DIR`` (or the system temp dir, never ``/dev/shm``) that is unlinked as it is created, so
  it has no path and never outlives the processes that map it. Both sides map it shared; only a small
  description (offsets, dtypes, shapes, and non-tensor leaves such as keys) goes through a pipe. Tensors are
  never pickled.

Both hand out batch ``j`` only in order and keep at most ``slots`` batches in flight. A yielded batch is
never overwritten while anything still views it (the batch, a slice, a numpy view): before a process slot
is refilled the consumer checks whether its mapping is still viewed, and if so gives the slot a new file
(sent to the worker over the pipe) and leaves the old mapping to whoever holds it. ``reuse=False`` gives
every batch fresh memory. An exception in a worker is re-raised in the consumer; a worker that dies raises
``RuntimeError`` (never a hang). A worker process exits when its parent dies, even mid-batch
(``PR_SET_PDEATHSIG`` on Linux, with the pipe and a parent-pid check as the fallback elsewhere). Linux sends
that signal when the *thread* that forked exits, so start the iteration (``iter(loader)``) in a thread that
outlives it; if that thread ends first, the next batch raises the dead-worker ``RuntimeError``. Worker threads
still running at interpreter exit are stopped and joined first (a daemon thread caught inside the native
gather by the shutdown would abort the process).

:func:`worker_info` says, inside a loader's Python code, which worker runs it and the current sample's seed.

Example::

    pipeline = ThreadPipeline(produce, n_batches=100, num_workers=2, slots=4)
    ok, (batch, size) = pipeline.get(0)
    pipeline.stop()
"""

from fastio.structure import map_structure
from fastio.workers.batch_pass import BatchPass
from fastio.workers.info import WorkerInfo, set_worker_info, worker_info
from fastio.workers.processes import ProcessPipeline
from fastio.workers.threads import ThreadPipeline

__all__ = [
    "BatchPass",
    "ProcessPipeline",
    "ThreadPipeline",
    "WorkerInfo",
    "map_structure",
    "set_worker_info",
    "worker_info",
]
