"""What a worker knows: :func:`worker_info` says, inside a loader's Python code, which worker runs it and
the current sample's seed; the loader sets it per thread with :func:`set_worker_info`.

Example::

    info = fastio.worker_info()   # None outside a loader's work
"""

from __future__ import annotations

import dataclasses
import threading

__all__ = ["WorkerInfo", "set_worker_info", "worker_info"]


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
