"""DataLoader's keyword arguments as a :class:`fastio.StreamLoader` reads them: checked with DataLoader's own
rules and messages (``torch.utils.data.DataLoader`` in torch 2.13), then turned into what fastio's parts
take. One function per argument group:

1. :func:`dataloader_worker_args`: ``num_workers``, ``prefetch_factor``, ``persistent_workers``,
   ``multiprocessing_context`` -> ``(prefetch, worker mode, start method)``.
2. :func:`pinned`: ``pin_memory`` and the deprecated ``pin_memory_device`` -> whether buffers are pinned.
3. :func:`unbatched_collate`: ``batch_size=None`` (no auto-collation) -> the per-sample collate.
4. :func:`distributed_defaults` and :func:`collate_fn_argument`: the rank split's defaults, and
   ``collate_fn`` beside its deprecated old name ``collate=``.

Example::

    prefetch, mode, method = dataloader_worker_args(2, None, 4, False, "spawn", "auto")
    assert (prefetch, mode, method) == (6, "process", "spawn")
"""

from __future__ import annotations

import multiprocessing.context
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import default_convert

__all__ = [
    "PerSample",
    "collate_fn_argument",
    "dataloader_worker_args",
    "distributed_defaults",
    "pinned",
    "start_method",
    "unbatched_collate",
]


def start_method(multiprocessing_context: Any, num_workers: int) -> str | None:
    """The start method of DataLoader's ``multiprocessing_context`` (a method's name or a context object),
    checked as DataLoader checks it; None when none was given.

    Example::

        start_method(multiprocessing.get_context("spawn"), num_workers=1) == "spawn"
    """
    if multiprocessing_context is None:
        return None
    if num_workers == 0:
        raise ValueError(
            "multiprocessing_context can only be used with multi-process loading (num_workers > 0), but got "
            f"num_workers={num_workers}"
        )
    if isinstance(multiprocessing_context, str):
        valid = torch.multiprocessing.get_all_start_methods()
        if multiprocessing_context not in valid:
            raise ValueError(
                f"multiprocessing_context option should specify a valid start method in {valid!r}, but got "
                f"multiprocessing_context={multiprocessing_context!r}"
            )
        return multiprocessing_context
    if not isinstance(multiprocessing_context, multiprocessing.context.BaseContext):
        raise TypeError(
            "multiprocessing_context option should be a valid context object or a string specifying the "
            f"start method, but got multiprocessing_context={multiprocessing_context}"
        )
    return multiprocessing_context.get_start_method()


def dataloader_worker_args(
    num_workers: int,
    prefetch: int | None,
    prefetch_factor: int | None,
    persistent_workers: bool,
    multiprocessing_context: Any,
    worker_mode: str,
) -> tuple[int, str, str]:
    """DataLoader's worker arguments, checked with DataLoader's own messages where it has them, as fastio's
    ``(prefetch, worker_mode, start_method)``.

    1. ``prefetch_factor`` (batches in flight per worker) becomes ``prefetch``, the batches in flight beyond
       ``num_workers``: ``max(1, (prefetch_factor - 1) * num_workers)``; only one of the two may be given.
    2. ``multiprocessing_context`` (``"fork"``, ``"spawn"``, ``"forkserver"`` or a context object) is how
       worker processes start (default ``"fork"``); it means worker processes: ``worker_mode="auto"``
       becomes ``"process"``, ``"thread"`` is refused.
    3. ``persistent_workers=True`` needs ``num_workers > 0`` and keeps whichever workers the mode gives.

    Example::

        dataloader_worker_args(2, None, 4, False, "fork", "auto") == (6, "process", "fork")
    """
    if num_workers == 0 and prefetch_factor is not None:
        raise ValueError(
            "prefetch_factor option could only be specified in multiprocessing."
            "let num_workers > 0 to enable multiprocessing, otherwise set prefetch_factor to None."
        )
    if prefetch_factor is not None and prefetch_factor < 0:
        raise ValueError("prefetch_factor option should be non-negative")
    if prefetch_factor is not None and prefetch is not None:
        raise ValueError(
            "pass WorkerOptions(prefetch=) (batches beyond num_workers) or DataLoader's prefetch_factor=, "
            "not both"
        )
    if persistent_workers and num_workers == 0:
        raise ValueError("persistent_workers option needs num_workers > 0")
    if prefetch_factor is not None:
        prefetch = max(1, (prefetch_factor - 1) * num_workers)
    method = start_method(multiprocessing_context, num_workers)
    if method is not None and worker_mode == "thread":
        raise ValueError(
            f"multiprocessing_context={method!r} asks for worker processes, but WorkerOptions(mode='thread') "
            "was given; drop one of the two"
        )
    if method is not None and worker_mode == "auto":
        worker_mode = "process"
    return (2 if prefetch is None else prefetch), worker_mode, method or "fork"


def pinned(pin_memory: bool | None, pin_memory_device: str, cuda_device: bool) -> bool:
    """Whether output buffers are page-locked. ``pin_memory`` defaults to False, as in DataLoader, but to True
    with fastio's own CUDA ``device=`` (its side-stream copy overlaps compute only from pinned memory). As in
    DataLoader (torch 2.13): ``pin_memory_device`` is deprecated and ignored, with its warning, when
    ``pin_memory=True`` (the current accelerator pins), silently otherwise; ``pin_memory=True`` without an
    accelerator warns and pins nothing.

    Example::

        pinned(None, "", cuda_device=False) is False
    """
    pin = cuda_device if pin_memory is None else bool(pin_memory)
    if pin and pin_memory_device:
        warnings.warn(
            "pin_memory_device is deprecated, the current accelerator will be used as the device,"
            f"ignore pin_memory_device='{pin_memory_device}'.",
            stacklevel=3,
        )
    if pin and not torch.accelerator.is_available():
        warnings.warn(
            "'pin_memory' argument is set as true but no accelerator is found, then device pinned memory "
            "won't be used.",
            stacklevel=3,
        )
        return False
    return pin


class PerSample:
    """``batch_size=None``'s collate (DataLoader's samples without auto-collation): each "batch" is one
    sample, handed to ``collate_fn`` alone (default ``default_convert``: numpy arrays become tensors, the rest
    stays). Picklable when ``collate_fn`` is.

    Example::

        PerSample(None)([{"y": 3}]) == {"y": 3}
    """

    def __init__(self, collate_fn: Callable[[Any], Any] | None) -> None:
        self.collate_fn = collate_fn

    def __call__(self, samples: list[Any]) -> Any:
        return (self.collate_fn or default_convert)(samples[0])


def unbatched_collate(
    collate_fn: Callable[[Any], Any] | None, drop_last: bool, batch_sampler: Any
) -> PerSample:
    """The collate of ``batch_size=None`` after DataLoader's checks of it (``drop_last`` and
    ``batch_sampler`` are refused with DataLoader's messages).

    Example::

        collate = unbatched_collate(None, drop_last=False, batch_sampler=None)
    """
    if batch_sampler is not None:
        raise ValueError(
            "batch_sampler option is mutually exclusive with batch_size, shuffle, sampler, and drop_last"
        )
    if drop_last:
        raise ValueError(
            "batch_size=None option disables auto-batching and is mutually exclusive with drop_last"
        )
    return PerSample(collate_fn)


def distributed_defaults(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """``rank`` and ``world_size``, each from ``torch.distributed`` where not given (0 and 1 without it).

    Example::

        distributed_defaults(None, None) == (0, 1)   # no process group
    """
    dist = torch.distributed
    initialised = dist.is_available() and dist.is_initialized()
    if world_size is None:
        world_size = dist.get_world_size() if initialised else 1
    if rank is None:
        rank = dist.get_rank() if initialised else 0
    return int(rank), int(world_size)


def collate_fn_argument(
    collate_fn: Callable[[list[Any]], Any] | None, deprecated: dict[str, Any]
) -> Callable[[list[Any]], Any] | None:
    """DataLoader's ``collate_fn``, or the loader's old name for it, ``collate=`` (warns; removed from
    ``deprecated``).

    Example::

        collate_fn_argument(None, {}) is None
    """
    if "collate" not in deprecated:
        return collate_fn
    collate = deprecated.pop("collate")
    if collate_fn is not None:
        raise ValueError("pass collate_fn= (DataLoader's name) only; collate= is its old name")
    warnings.warn(
        "StreamLoader(collate=...) is deprecated and goes in the next release; pass collate_fn=...",
        DeprecationWarning,
        stacklevel=3,
    )
    return collate
