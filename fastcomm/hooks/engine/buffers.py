"""Per-bucket buffers reused from step to step (send, receive and result buffers, decode accumulators).

Large fresh tensors cost page faults on every step, so each bucket keeps its wire buffers. A hook may
reuse a buffer from its next call on the same bucket: by then DDP has waited for every collective and
callback of the previous iteration.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import Tensor

from fastcomm.hooks.engine.util import BucketKey

__all__ = ["BufferPool", "KeyedBuffers"]

T = TypeVar("T")


class BufferPool:
    """Buffers and small objects kept per ``(bucket key, name)``, dropped with their bucket layout.

    Example::

        pool = BufferPool()
        send = pool.tensor((0, 1), "send", like=torch.empty(0, dtype=torch.uint8), numel=1024)
        assert pool.tensor((0, 1), "send", like=send, numel=1024) is send
    """

    def __init__(self) -> None:
        self._tensors: dict[tuple[BucketKey, str], Tensor] = {}
        self._objects: dict[tuple[BucketKey, str], Any] = {}

    def tensor(self, key: BucketKey, name: str, like: Tensor, numel: int) -> Tensor:
        """Bucket ``key``'s uninitialised buffer ``name``: ``numel`` elements, ``like``'s dtype and device."""
        buffer = self._tensors.get((key, name))
        wanted = (numel, like.dtype, like.device)
        if buffer is None or (buffer.numel(), buffer.dtype, buffer.device) != wanted:
            buffer = like.new_empty(numel)
            self._tensors[(key, name)] = buffer
        return buffer

    def scratch(self, key: BucketKey, device: torch.device) -> Callable[[str, int], Tensor]:
        """``scratch(name, numel)``: bucket ``key``'s reusable uint8 buffers (for chunked collectives)."""
        like = torch.empty(0, dtype=torch.uint8, device=device)
        return lambda name, numel: self.tensor(key, name, like, numel)

    def keyed(self, key: BucketKey) -> KeyedBuffers:
        """Bucket ``key``'s buffers as a collective asks for them (:class:`~fastcomm.collectives.Buffers`)."""
        return KeyedBuffers(self, key)

    def object(self, key: BucketKey, name: str, make: Callable[[], T], fits: Callable[[T], bool]) -> T:
        """Bucket ``key``'s object ``name`` (a decode accumulator, say): kept while ``fits`` it, else new."""
        found = self._objects.get((key, name))
        if found is None or not fits(found):
            found = self._objects[(key, name)] = make()
        return found

    def drop(self, key: BucketKey) -> None:
        """Forget every buffer and object of bucket layout ``key`` (after a bucket rebuild)."""
        for table in (self._tensors, self._objects):
            # list(table) copies the keys in one step under the GIL: the phase-2 thread may be adding
            # another layout's buffers meanwhile, which a comprehension over the dict itself trips on
            for stale in [k for k in list(table) if k[0] == key]:
                del table[stale]


class KeyedBuffers:
    """One bucket's buffers of a :class:`BufferPool`: ``tensor(name, like, numel)``, as collectives ask."""

    def __init__(self, pool: BufferPool, key: BucketKey) -> None:
        self.pool, self.key = pool, key

    def tensor(self, name: str, like: Tensor, numel: int) -> Tensor:
        return self.pool.tensor(self.key, name, like, numel)
