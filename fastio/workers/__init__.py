"""The two ways a :class:`fastio.StreamLoader` makes batches ahead of its consumer, and what a worker knows.

* :class:`ThreadPipeline`: threads call the producer; the native gather releases the GIL, so threads are
  the fast path for shards and tar members. Batches land in the producer's reused buffers
  (:class:`fastio.sources.BufferPool`: a set is refilled only when nothing outside still views it).
* :class:`ProcessPipeline`: worker processes (forked, or spawned from a picklable factory) call the
  producer (for Python transforms, collates and Datasets that hold the GIL). Each process writes the
  tensors of its batch into a ring slot: a file in ``$FASTIO_WORKER_DIR`` (or the system temp dir, never
  ``/dev/shm``) that is unlinked as it is created, so it has no path and never outlives the processes that
  map it. Both sides map it shared; only a small description (offsets, dtypes, shapes, and non-tensor
  leaves such as keys) goes through a pipe. Tensors are never pickled.

Both hand out batch ``j`` in order (``get``) or whichever is made first (``get_ready``), keep at most
``slots`` batches in flight, never overwrite a batch anything still views, serve the next pass when kept
(:class:`fastio.workers.kept.KeptWorkers`, DataLoader's ``persistent_workers``), and re-raise a worker's
exception (or a dead worker's ``RuntimeError``) in the consumer: the details are in
:mod:`fastio.workers.processes` and :mod:`fastio.workers.threads`.

:func:`worker_info` says, inside a loader's Python code, which worker runs it and the current sample's seed.

Example::

    pipeline = ThreadPipeline(produce, n_batches=100, num_workers=2, slots=4)
    ok, (batch, size) = pipeline.get(0)
    pipeline.stop()
"""

from fastio.assembly.structure import map_structure
from fastio.workers.batch_pass import BatchPass
from fastio.workers.info import PassInfo, WorkerInfo, set_worker_info, worker_info
from fastio.workers.processes import ProcessPipeline
from fastio.workers.threads import ThreadPipeline

__all__ = [
    "BatchPass",
    "PassInfo",
    "ProcessPipeline",
    "ThreadPipeline",
    "WorkerInfo",
    "map_structure",
    "set_worker_info",
    "worker_info",
]
