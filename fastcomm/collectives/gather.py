"""Exchanges by all-gather: every rank's payload reaches every rank (non-blockwise compressors, top-k).

:func:`all_gather_rows` issues one logical all-gather as several back-to-back async chunks. gloo moves one
large buffer per collective with a single send and receive per peer, so a shaped TCP link sits idle between
them (:mod:`fastcomm.collectives._layout`). A chunk is a column range ``[a, b)`` of the ``(W, L)`` rows
(row ``j`` from rank ``j``); it travels in a contiguous scratch slice of ``W * (b - a)`` bytes, and the
chunks are copied back into row order once all have arrived.

:func:`start_gather` is the compressed all-reduce of a compressor whose payload belongs to the whole tensor
(``block == 0``): compress ``x`` (with error feedback), all-gather the payloads, decode them in rank order
(the first overwrites, the others add, each divided by ``W``). :func:`start_gather_rows` is the compressed
all-gather: each rank's decoded tensor in its own row of the output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from fastcomm.collectives._layout import Buffers, ScratchFn, all_gather_flat, chunk_edges, scratch_of
from fastcomm.collectives._threads import then
from fastcomm.compress.protocol import Compressor

__all__ = ["Gathered", "all_gather_rows", "compress_row", "decode_mean", "decode_rows", "gather_row"]


def _pairs(edges: list[int]) -> list[tuple[int, int]]:
    return list(zip(edges[:-1], edges[1:], strict=True))


def all_gather_rows(
    out: Tensor, row: Tensor, *, group: dist.ProcessGroup | None, chunk_bytes: int, scratch: ScratchFn
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


@dataclass
class Gathered:
    """An all-gather of payloads in flight: the ``(W, L)`` rows, the future filling them, the bytes sent."""

    rows: Tensor
    future: torch.futures.Future[Tensor]
    sent_bytes: int


def compress_row(
    compressor: Compressor,
    x: Tensor,
    residual_out: Tensor | None,
    residual_in: Tensor | None,
    buffers: Buffers,
    seed: int = 0,
) -> Tensor:
    """``x + residual_in`` compressed into the reusable buffer ``"row"``; ``residual_out`` gets the rest."""
    uint8 = torch.empty(0, dtype=torch.uint8, device=x.device)
    row = buffers.tensor("row", uint8, compressor.wire_bytes(x.numel(), x.dtype))
    compressor.compress_into(row, x, residual_out, residual_in, seed)
    return row


def gather_row(
    row: Tensor, *, world_size: int, group: dist.ProcessGroup | None, chunk_bytes: int, buffers: Buffers
) -> Gathered:
    """All-gather this rank's payload ``row`` from every rank, in chunks (buffer ``"gathered"``)."""
    rows = buffers.tensor("gathered", row, world_size * row.numel()).view(world_size, -1)
    scratch = scratch_of(buffers, row.device)
    future = all_gather_rows(rows, row, group=group, chunk_bytes=chunk_bytes, scratch=scratch)
    return Gathered(rows, future, (world_size - 1) * row.numel())


def decode_mean(compressor: Compressor, rows: Tensor, out: Tensor, divisor: int) -> bool:
    """Decode every row of ``rows`` in rank order into ``out``, summed, each divided by ``divisor``.

    Returns whether the payloads decode finite.
    """
    numel = out.numel()
    finite = compressor.payload_finite(rows, numel, out.dtype)
    for source in range(rows.shape[0]):
        compressor.decompress_into(out, rows[source], numel, source > 0, divisor)
    return finite


def decode_rows(compressor: Compressor, rows: Tensor, out: Tensor) -> bool:
    """Decode row ``i`` of ``rows`` into ``out[i]`` (``out``: ``(W, n)``); whether they decode finite."""
    numel = out.shape[1]
    finite = compressor.payload_finite(rows, numel, out.dtype)
    for source in range(rows.shape[0]):
        compressor.decompress_into(out[source], rows[source], numel)
    return finite

