"""What a worker knows: :func:`worker_info` says, inside a loader's Python code, which worker runs it and
the current sample's seed; the loader sets it per thread with :func:`set_worker_info`, and a worker thread
sets it for each pass it serves with a :class:`PassInfo` (which runs ``worker_init_fn`` after it, once).

Example::

    info = fastio.worker_info()   # None outside a loader's work
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable

__all__ = ["PassInfo", "WorkerInfo", "set_worker_info", "worker_info"]


@dataclasses.dataclass(frozen=True)
class WorkerInfo:
    """Who runs the loader's Python code right now (see :func:`worker_info`).

    Attributes:
        id: the worker's index, ``0 <= id < max(1, num_workers)``.
        num_workers: the loader's ``num_workers`` (0: the consumer's own thread).
        seed: the loader's seed.
        epoch: the epoch being made.
        sample_seed: inside a ``transform`` call, the current sample's 64-bit seed
            (:func:`fastio.assembly.seeding.sample_seeds` of ``(seed, epoch, sample index)``,
            ``STREAM_TRANSFORM``); None elsewhere. Seed your own generator from it where the global ones
            are shared (worker threads): ``torch.Generator().manual_seed(info.sample_seed)``.
    """

    id: int
    num_workers: int
    seed: int
    epoch: int
    sample_seed: int | None = None


_current = threading.local()


def worker_info() -> WorkerInfo | None:
    """The :class:`WorkerInfo` of the loader work running in this thread; None outside a loader's work.

    Set in worker threads and processes, and in the consumer's thread while it makes a batch itself
    (``num_workers=0``). ``torch.utils.data.get_worker_info()`` answers too, in worker processes only (it is
    one process-wide value, which worker threads cannot share).

    Example::

        def transform(sample):
            info = fastio.worker_info()
            noise = torch.randn(3, generator=torch.Generator().manual_seed(info.sample_seed))
            return {**sample, "noise": noise}
    """
    return getattr(_current, "info", None)


def set_worker_info(info: WorkerInfo | None) -> WorkerInfo | None:
    """Make ``info`` what :func:`worker_info` returns in this thread; returns what it returned before.

    Example::

        previous = set_worker_info(WorkerInfo(id=0, num_workers=0, seed=0, epoch=0))
        set_worker_info(previous)
    """
    previous = worker_info()
    _current.info = info
    return previous


@dataclasses.dataclass(frozen=True)
class PassInfo:
    """What a worker thread runs before its first batch of a pass: sets this pass's :func:`worker_info`
    (``WorkerInfo(worker_id, num_workers, seed, epoch)``), then runs ``init_fn(worker_id)`` (DataLoader's
    ``worker_init_fn``) when given. Give ``init_fn`` to the thread's first pass only: a kept thread
    (``persistent_workers=True``) serves its later passes with ``PassInfo`` of none, so it runs once per
    worker.

    Example::

        pipeline = ThreadPipeline(produce, n_batches, num_workers=2, slots=4,
                                  worker_init=PassInfo(2, seed=0, epoch=0, init_fn=worker_init_fn))
        pipeline.next_pass((next_produce, PassInfo(2, seed=0, epoch=1)), n_batches, times)
    """

    num_workers: int
    seed: int
    epoch: int
    init_fn: Callable[[int], None] | None = None

    def __call__(self, worker_id: int) -> None:
        set_worker_info(WorkerInfo(worker_id, self.num_workers, self.seed, self.epoch))
        if self.init_fn is not None:
            self.init_fn(worker_id)
