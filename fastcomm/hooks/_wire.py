"""Chunked collectives: one logical all-to-all or all-gather issued as several back-to-back async chunks.

Why: gloo moves one large buffer per collective with a single send and a single receive per peer, so a
shaped TCP link sits idle between them. On the 1 Gbit/s benchmark link (119 MB/s each way) one 8 MB
all-to-all ran at 61 MB/s per direction and one all-gather at 80 MB/s; split into 16 chunks issued
together they reached 115 and 119 MB/s (``benchmarks/bench_hooks.py`` notes the measurement). Chunks are
issued from the calling thread in a fixed order computed from sizes alone, so every rank issues the same
collectives in the same order.

Rows: both exchanges move a ``(W, L)`` uint8 matrix whose row ``j`` belongs to rank ``j``. A chunk is a
column range ``[a, b)`` of it; each chunk travels in a contiguous scratch slice of ``W * (b - a)`` bytes,
and the received chunks are copied back into row order once all have arrived.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "MAX_CHUNKS",
    "RowExchange",
    "all_gather_rows",
    "all_to_all_rows",
    "chunk_edges",
]

DEFAULT_CHUNK_BYTES = 1 << 19
MAX_CHUNKS = 64

# all_gather_into_tensor was renamed all_gather_single; use whichever this torch has, without a warning.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

Scratch = Callable[[str, int], Tensor]


def chunk_edges(length: int, chunk_bytes: int, max_chunks: int = MAX_CHUNKS) -> list[int]:
    """Column edges ``[0, ..., length]`` of about ``chunk_bytes`` each (at most ``max_chunks`` chunks).

    Example::

        >>> chunk_edges(10, 4)
        [0, 3, 6, 10]
    """
    if length <= 0:
        return [0, max(length, 0)]
    count = max(1, min(max_chunks, -(-length // max(1, chunk_bytes))))
    return [length * i // count for i in range(count + 1)]


def _pairs(edges: list[int]) -> list[tuple[int, int]]:
    return list(zip(edges[:-1], edges[1:], strict=True))


class RowExchange:
    """An all-to-all in flight: :meth:`wait` blocks until every chunk arrived and the rows are in place."""

    def __init__(self, works: list[dist.Work], finalize: Callable[[], None]) -> None:
        self._works, self._finalize = works, finalize

    def wait(self) -> None:
        for work in self._works:
            work.wait()
        works, self._works = self._works, []
        if works:
            self._finalize()


def all_to_all_rows(
    recv: Tensor, send: Tensor, *, group: dist.ProcessGroup | None, chunk_bytes: int, scratch: Scratch
) -> RowExchange:
    """Send row ``j`` of ``send`` to rank ``j``; row ``i`` of ``recv`` receives rank ``i``'s row for us.

    Args:
        recv: ``(W, L)`` uint8, written once :meth:`RowExchange.wait` returns.
        send: ``(W, L)`` uint8; may be reused as soon as this function returns.
        group: the process group.
        chunk_bytes: bytes per peer per chunk.
        scratch: ``scratch(name, numel)`` returns a reusable uint8 buffer (kept per bucket by the state).
    """
    world, length = send.shape
    edges = chunk_edges(length, chunk_bytes)
    if len(edges) == 2:
        work = dist.all_to_all_single(recv.view(-1), send.view(-1), group=group, async_op=True)
        return RowExchange([work], lambda: None)
    send_chunks = scratch("a2a_send", world * length)
    recv_chunks = scratch("a2a_recv", world * length)
    works = []
    for a, b in _pairs(edges):
        piece = send_chunks[world * a : world * b]
        piece.view(world, b - a).copy_(send[:, a:b])
        received = recv_chunks[world * a : world * b]
        works.append(dist.all_to_all_single(received, piece, group=group, async_op=True))

    def finalize() -> None:
        for a, b in _pairs(edges):
            recv[:, a:b].copy_(recv_chunks[world * a : world * b].view(world, b - a))

    return RowExchange(works, finalize)


def all_gather_rows(
    out: Tensor, row: Tensor, *, group: dist.ProcessGroup | None, chunk_bytes: int, scratch: Scratch
) -> torch.futures.Future[Tensor]:
    """All-gather ``row`` (``L`` uint8) into ``out`` (``(W, L)``, row ``i`` from rank ``i``).

    Returns:
        A future holding ``out``, completed once every chunk arrived and the rows are in place; a failed
        chunk fails it.
    """
    world, length = out.shape
    edges = chunk_edges(length, chunk_bytes)
    if len(edges) == 2:
        work = _all_gather_flat(out.view(-1), row, group=group, async_op=True)

        def gathered_rows(done: torch.futures.Future[list[Tensor]]) -> Tensor:
            done.value()  # raises the collective's error, if any
            return out

        return work.get_future().then(gathered_rows)
    gathered = scratch("ag_out", world * length)
    futures = [
        _all_gather_flat(gathered[world * a : world * b], row[a:b], group=group, async_op=True).get_future()
        for a, b in _pairs(edges)
    ]

    def reassemble(done: torch.futures.Future[list[torch.futures.Future]]) -> Tensor:
        for future in done.value():
            future.value()  # raises the chunk's error, if any
        for a, b in _pairs(edges):
            out[:, a:b].copy_(gathered[world * a : world * b].view(world, b - a))
        return out

    return torch.futures.collect_all(futures).then(reassemble)
