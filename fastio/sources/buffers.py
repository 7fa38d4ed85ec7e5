"""The reused output memory of the batches in flight: :class:`BatchBuffers` (one batch's tensors) and
:class:`BufferPool` (the sets of a pass; a set is refilled only when nothing outside the loader views it).

Example::

    pool = BufferPool({"y": (torch.int64, ())}, batch_size=4, pin=False, keep=3)
    buffers = pool.acquire()
"""

from __future__ import annotations

import threading
from typing import Any

import torch

__all__ = ["BatchBuffers", "BufferPool", "storage_refs"]


class BatchBuffers:
    """Reused output tensors of one in-flight batch: ``[batch_size, *shape]`` per fixed field (pinned when
    asked) and one growable uint8 payload buffer per variable field.

    Example::

        buffers = BatchBuffers({"x": (torch.uint8, (3, 32, 32))}, batch_size=256, pin=False)
        out = buffers.fixed("x", 100)   # a view of the first 100 rows
    """

    def __init__(
        self, specs: dict[str, tuple[torch.dtype, tuple[int, ...]]], batch_size: int, pin: bool
    ) -> None:
        self.pin = pin
        self._fixed = {
            name: torch.empty((batch_size, *shape), dtype=dtype, pin_memory=pin)
            for name, (dtype, shape) in specs.items()
        }
        self._payload: dict[str, torch.Tensor] = {}
        self.event: Any = None  # a CUDA event: the last host-to-device copy out of these buffers

    def fixed(self, name: str, rows: int) -> torch.Tensor:
        return self._fixed[name][:rows]

    def payload(self, name: str, nbytes: int) -> torch.Tensor:
        buf = self._payload.get(name)
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(max(nbytes, 1) * 5 // 4 + 64, dtype=torch.uint8, pin_memory=self.pin)
            self._payload[name] = buf
        return buf[:nbytes]

    def held(self) -> bool:
        """True while any tensor outside these buffers still views their memory (a batch the consumer
        kept, a slice of it, a numpy view of it): refilling them now would change data someone holds.

        Counts the references to each buffer's storage: the buffer itself holds one, every live view one.

        Example::

            buffers = BatchBuffers({"y": (torch.int64, ())}, batch_size=4, pin=False)
            kept = buffers.fixed("y", 4)
            assert buffers.held()
            del kept
            assert not buffers.held()
        """
        return any(storage_refs(t) > 1 for t in (*self._fixed.values(), *self._payload.values()))

    def held_count(self) -> tuple[int, int]:
        """``(held, total)``: how many of the buffers are held (see :meth:`held`), of how many."""
        buffers = (*self._fixed.values(), *self._payload.values())
        return sum(storage_refs(t) > 1 for t in buffers), len(buffers)

    def renew_held(self) -> None:
        """Replace every held buffer with fresh memory and leave the old one to whoever views it: a user who
        keeps only the labels of each batch costs one small allocation per batch, not a new image buffer.

        Example::

            buffers = BatchBuffers({"y": (torch.int64, ()), "x": (torch.uint8, (8,))}, 4, pin=False)
            kept, x = buffers.fixed("y", 4), buffers.fixed("x", 4).data_ptr()
            buffers.renew_held()
            assert buffers.fixed("y", 4).data_ptr() != kept.data_ptr()
            assert buffers.fixed("x", 4).data_ptr() == x
        """
        for name, t in self._fixed.items():
            if storage_refs(t) > 1:
                self._fixed[name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=self.pin)
        self._payload = {name: t for name, t in self._payload.items() if storage_refs(t) == 1}


class BufferPool:
    """The :class:`BatchBuffers` of the batches in flight: a set is refilled only when nothing outside the
    loader still views it (:meth:`BatchBuffers.held`); otherwise a fresh set is made and the held one is left
    to whoever holds it. Thread-safe.

    1. :meth:`acquire` hands out an idle set that is not held; else the idle set with the fewest held
       buffers, those renewed (:meth:`BatchBuffers.renew_held`), if some of it is free; else a new set.
    2. :meth:`release` takes it back once the batch is made (its views then live in the batch); at most
       ``keep`` sets are kept for reuse, dropping the longest-held first. ``keep=0``: fresh sets every time.

    Example::

        pool = BufferPool({"y": (torch.int64, ())}, batch_size=4, pin=False, keep=3)
        buffers = pool.acquire()
        kept = buffers.fixed("y", 4)
        pool.release(buffers)
        assert pool.acquire() is not buffers   # `kept` still views it: a fresh set
    """

    def __init__(
        self, specs: dict[str, tuple[torch.dtype, tuple[int, ...]]], batch_size: int, pin: bool, keep: int
    ) -> None:
        self.specs, self.batch_size, self.pin, self.keep = specs, batch_size, pin, keep
        self._idle: list[BatchBuffers] = []
        self._lock = threading.Lock()

    def acquire(self) -> BatchBuffers:
        with self._lock:
            for i, buffers in enumerate(self._idle):
                if not buffers.held():
                    return self._idle.pop(i)
            free = [total - held for held, total in (buffers.held_count() for buffers in self._idle)]
            if free and max(free) > 0:
                buffers = self._idle.pop(free.index(max(free)))
                buffers.renew_held()
                return buffers
        return BatchBuffers(self.specs, self.batch_size, self.pin)

    def release(self, buffers: BatchBuffers) -> None:
        if not self.keep:
            return
        with self._lock:
            self._idle.append(buffers)
            if len(self._idle) > self.keep:
                self._idle.pop(next((i for i, b in enumerate(self._idle) if b.held()), 0))


def storage_refs(tensor: torch.Tensor) -> int:
    """Tensors (and views) sharing ``tensor``'s storage, ``tensor`` itself included.

    Example::

        base = torch.zeros(4)
        view = base[1:]
        assert storage_refs(base) == 2
    """
    # untyped_storage() makes a temporary Python storage that holds one reference of its own.
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata) - 1
