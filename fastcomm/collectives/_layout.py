"""How a compressed collective cuts a tensor: segments, pieces and chunks; reusable buffers; small helpers.

* A *segment* is one rank's share of a blockwise exchange: a multiple of ``lcm(block, 8)`` elements
  (whole blocks and whole bytes), so any segment is compressed and decoded on its own.
* A *piece* is a run of whole units of a segment, sent in its own collective (about ``chunk_bytes`` of
  payload, at most ``MAX_CHUNKS``), so a rank works on piece ``c`` while later pieces are on the wire, and
  several transfers in flight keep a TCP link busy (one large gloo transfer does not: on a 1 Gbit/s link
  one 8 MB all-to-all moved 61 MB/s each way, 16 chunks 115 MB/s).
* A *chunk* is a column range of an all-gather's ``(W, L)`` rows.

Every size here follows from element counts alone, so every rank computes the same cuts and issues the same
collectives, of the same sizes, in the same order.
"""

from __future__ import annotations

import math
import time
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "MAX_CHUNKS",
    "Buffers",
    "FreshBuffers",
    "Timer",
    "all_gather_flat",
    "block_unit",
    "chunk_edges",
    "completed",
    "piece_ranges",
    "profiled",
    "scratch_of",
    "segment_layout",
]

DEFAULT_CHUNK_BYTES = 1 << 19
MAX_CHUNKS = 64

# all_gather_into_tensor was renamed all_gather_single; use whichever this torch has, without a warning.
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Buffers(Protocol):
    """Where a collective gets its wire buffers: the DDP hooks keep them per bucket, a plain call anew."""

    def tensor(self, name: str, like: Tensor, numel: int) -> Tensor:
        """An uninitialised buffer ``name``: ``numel`` elements of ``like``'s dtype, on its device."""
        ...


class FreshBuffers:
    """:class:`Buffers` that allocate every buffer anew (a collective called outside a hook).

    Example::

        send = FreshBuffers().tensor("send", torch.empty(0, dtype=torch.uint8), 1024)
    """

    def tensor(self, name: str, like: Tensor, numel: int) -> Tensor:
        return like.new_empty(numel)


def scratch_of(buffers: Buffers, device: torch.device) -> ScratchFn:
    """``scratch(name, numel)``: ``buffers``' uint8 buffers on ``device`` (for chunked collectives)."""
    like = torch.empty(0, dtype=torch.uint8, device=device)
    return lambda name, numel: buffers.tensor(name, like, numel)


class ScratchFn(Protocol):
    def __call__(self, name: str, numel: int) -> Tensor: ...


def block_unit(block: int) -> int:
    """The piece granularity for ``block``-element blocks: ``lcm(block, 8)`` (whole blocks, whole bytes).

    Example::

        >>> block_unit(100)
        200
    """
    return math.lcm(block, 8)


def segment_layout(numel: int, world_size: int, unit: int) -> int:
    """Length of each rank's segment: ``ceil(numel / W)`` rounded up to ``unit``.

    Example::

        >>> segment_layout(1000, 2, 64)
        512
    """
    per_rank = max(1, math.ceil(numel / world_size))
    return math.ceil(per_rank / unit) * unit


def piece_ranges(segment: int, unit: int, payload_bytes: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """Element ranges ``[start, stop)`` cutting a segment into pieces of whole ``unit``\\ s.

    Args:
        segment: elements per segment, a multiple of ``unit``.
        unit: the granularity, ``lcm(block, 8)``: whole blocks and whole bytes.
        payload_bytes: compressed bytes of one segment (codes and scales).
        chunk_bytes: the wanted payload per piece; at most ``MAX_CHUNKS`` pieces.

    Example::

        >>> piece_ranges(1024, 256, 1040, 512)
        [(0, 256), (256, 512), (512, 768), (768, 1024)]
    """
    units = max(1, segment // unit)
    count = max(1, min(units, MAX_CHUNKS, -(-payload_bytes // max(1, chunk_bytes))))
    edges = [units * i // count * unit for i in range(count + 1)]
    edges[-1] = segment
    return list(zip(edges[:-1], edges[1:], strict=True))


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


def profiled(name: str, bucket: int | None, what: str) -> torch.profiler.record_function:
    """A ``torch.profiler`` range for one step of an exchange: ``fastcomm <name> <what> [bucket <i>]``.

    A trace then shows compression, transfer and decode per bucket and phase (free when not profiling).
    """
    suffix = "" if bucket is None else f" bucket {bucket}"
    return torch.profiler.record_function(f"fastcomm {name} {what}{suffix}")


def completed(tensor: Tensor) -> torch.futures.Future[Tensor]:
    """A future that already holds ``tensor``."""
    future: torch.futures.Future[Tensor] = torch.futures.Future()
    future.set_result(tensor)
    return future


class Timer:
    """Accumulates the wall time of the ``with`` blocks it guards (a collective's compression work).

    Example::

        timer = Timer()
        with timer:
            work()
        print(timer.seconds)
    """

    def __init__(self) -> None:
        self.seconds = 0.0
        self._start = 0.0

    def __enter__(self) -> Timer:
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds += time.perf_counter() - self._start
