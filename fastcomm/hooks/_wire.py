"""Chunked all-gathers: one logical all-gather issued as several back-to-back async chunks.

Why: gloo moves one large buffer per collective with a single send and a single receive per peer, so a
shaped TCP link sits idle between them. On the 1 Gbit/s benchmark link (119 MB/s each way) one 8 MB
all-to-all ran at 61 MB/s per direction and one all-gather at 80 MB/s; split into 16 chunks issued
together they reached 115 and 119 MB/s (``benchmarks/bench_hooks.py`` notes the measurement). Chunks are
issued from the calling thread in a fixed order computed from sizes alone, so every rank issues the same
collectives in the same order.

Rows: an all-gather fills a ``(W, L)`` uint8 matrix whose row ``j`` comes from rank ``j``. A chunk is a
column range ``[a, b)`` of it; each chunk travels in a contiguous scratch slice of ``W * (b - a)`` bytes,
and the received chunks are copied back into row order once all have arrived. (The two-phase hooks cut
their all-to-alls into pieces themselves: see :mod:`fastcomm.hooks._twophase`.)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from fastcomm.hooks._threads import then
from fastcomm.hooks._util import all_gather_flat

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "MAX_CHUNKS",
    "all_gather_rows",
    "chunk_edges",
]

DEFAULT_CHUNK_BYTES = 1 << 19
MAX_CHUNKS = 64

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
        work = all_gather_flat(out.view(-1), row, group=group, async_op=True)

        def gathered_rows(done: torch.futures.Future[list[Tensor]]) -> Tensor:
            done.value()  # raises the collective's error, if any
            return out

        return then(work.get_future(), gathered_rows)
    gathered = scratch("ag_out", world * length)
    futures = [
        all_gather_flat(gathered[world * a : world * b], row[a:b], group=group, async_op=True).get_future()
        for a, b in _pairs(edges)
    ]

    def reassemble(done: torch.futures.Future[list[torch.futures.Future]]) -> Tensor:
        for future in done.value():
            future.value()  # raises the chunk's error, if any
        for a, b in _pairs(edges):
            out[:, a:b].copy_(gathered[world * a : world * b].view(world, b - a))
        return out

    return then(torch.futures.collect_all(futures), reassemble)
