"""The gathers a batch is made of: rows and variable-length ranges copied from mapped files into an output
tensor, natively (``fastio._C``, threaded, SIGBUS-guarded) when :mod:`fastio._native` loaded it, else with
torch ops after a size check. The native module is looked up at each call, so tests can switch it off.

Example::

    out = torch.empty(2, 64, dtype=torch.uint8)
    gather_rows(table, np.zeros(2, np.int32), np.array([0, 64]), 64, out)
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from fastio import _native
from fastio.files.mapped import MappedFile, MappedTable

__all__ = ["gather_ranges", "gather_rows", "read_chunks", "read_ranges"]


def _flat_bytes(out: torch.Tensor) -> torch.Tensor:
    if not out.is_contiguous() or out.device.type != "cpu":
        raise ValueError("fastio gather: output must be a contiguous CPU tensor")
    return out.view(-1).view(torch.uint8)


def gather_rows(
    table: MappedTable,
    shard_ids: np.ndarray,
    offsets: np.ndarray,
    row_nbytes: int,
    out: torch.Tensor,
    num_threads: int = 1,
) -> None:
    """Copy ``row_nbytes`` bytes from ``(shard_ids[i], offsets[i])`` to row ``i`` of ``out``.

    Raises :class:`fastio.CorruptShardError` for a file that shrank since it was mapped: the native copy
    turns the SIGBUS of a read past the new end into that error; the torch fallback checks every touched
    file's size before it copies.

    Args:
        table: the mapped files ``shard_ids`` refer to.
        shard_ids: int32 ``[B]``, an index into ``table.files`` per sample.
        offsets: int64 ``[B]``, the byte offset of each row in its file.
        row_nbytes: bytes per row.
        out: a contiguous CPU tensor of at least ``B * row_nbytes`` bytes; row ``i`` lands at byte
            ``i * row_nbytes``.
        num_threads: threads of the native copy (the torch fallback uses torch's own).

    Example::

        out = torch.empty(2, 64, dtype=torch.uint8)
        gather_rows(table, np.zeros(2, np.int32), np.array([0, 64]), 64, out)
    """
    shard_ids = np.ascontiguousarray(shard_ids, dtype=np.int32)
    offsets = np.ascontiguousarray(offsets, dtype=np.int64)
    flat = _flat_bytes(out)
    if _native._C is not None:
        # No size check first: the copy is guarded, and a SIGBUS in it becomes the same named error.
        fault = _native._C.gather_rows(
            table.bases, table.limits, shard_ids, offsets, int(row_nbytes), flat.numpy(), int(num_threads)
        )
        if fault >= 0:
            table.raise_fault(shard_ids, offsets, fault)
        return
    table.check_sizes(shard_ids)  # the torch copies below have no SIGBUS guard: refuse a shrunk file first
    batch = len(offsets)
    rows = flat[: batch * row_nbytes].view(batch, row_nbytes)
    for shard in np.unique(shard_ids):
        src = table.files[int(shard)].tensor
        if len(src) < row_nbytes:
            raise IndexError(f"fastio gather: {table.files[int(shard)].path} is shorter than one row")
        # Every byte position as the start of a row: index_select then bounds-checks each offset.
        windows = src.as_strided((len(src) - row_nbytes + 1, row_nbytes), (1, 1))
        mask = shard_ids == shard
        picked = torch.from_numpy(offsets[mask])
        if mask.all():
            torch.index_select(windows, 0, picked, out=rows)
        else:
            rows[torch.from_numpy(np.flatnonzero(mask))] = torch.index_select(windows, 0, picked)


def gather_ranges(
    table: MappedTable,
    shard_ids: np.ndarray,
    offsets: np.ndarray,
    lengths: np.ndarray,
    out: torch.Tensor,
    num_threads: int = 1,
    dst: np.ndarray | None = None,
) -> np.ndarray:
    """Copy variable-length ranges into ``out``: back to back, or to the byte offsets ``dst`` when given
    (ranges must not overlap there); returns the int64 start of each in ``out``. A file that shrank since it
    was mapped raises :class:`fastio.CorruptShardError`, as in :func:`gather_rows`.

    Example::

        out = torch.empty(int(lengths.sum()), dtype=torch.uint8)
        starts = gather_ranges(table, ids, offsets, lengths, out)
    """
    shard_ids = np.ascontiguousarray(shard_ids, dtype=np.int32)
    offsets = np.ascontiguousarray(offsets, dtype=np.int64)
    lengths = np.ascontiguousarray(lengths, dtype=np.int64)
    if dst is None:
        dst = np.zeros(len(lengths), dtype=np.int64)
        if len(lengths) > 1:
            np.cumsum(lengths[:-1], out=dst[1:])
    else:
        dst = np.ascontiguousarray(dst, dtype=np.int64)
        if dst.shape != lengths.shape:
            raise ValueError(f"fastio gather_ranges: dst has shape {dst.shape}, lengths {lengths.shape}")
    flat = _flat_bytes(out)
    if _native._C is not None:
        fault = _native._C.gather_ranges(
            table.bases, table.limits, shard_ids, offsets, lengths, dst, flat.numpy(), int(num_threads)
        )
        if fault >= 0:
            table.raise_fault(shard_ids, offsets, fault)
        return dst
    table.check_sizes(shard_ids)
    if len(lengths) and int((dst + lengths).max()) > len(flat) or (dst < 0).any():
        raise ValueError(
            f"fastio gather_ranges: output holds {len(flat)} bytes, batch writes up to "
            f"{int((dst + lengths).max())}"
        )
    for i, (shard, start, length, to) in enumerate(zip(shard_ids, offsets, lengths, dst, strict=True)):
        src = table.files[int(shard)]
        if start < 0 or start + length > src.size:
            raise IndexError(f"fastio gather: sample {i} reads past the end of {src.path} ({src.size} bytes)")
        flat[to : to + length] = src.tensor[start : start + length]
    return dst


def read_ranges(
    table: MappedTable, shard_ids: np.ndarray, offsets: np.ndarray, lengths: np.ndarray
) -> list[bytes]:
    """The bytes of each range, as :class:`bytes` objects, read through :func:`gather_ranges` (so a file
    truncated while mapped raises :class:`fastio.CorruptShardError` rather than killing the process).

    Example::

        texts = read_ranges(table, ids, offsets, lengths)
    """
    lengths = np.ascontiguousarray(lengths, dtype=np.int64)
    payload = np.empty(int(lengths.sum()), dtype=np.uint8)
    starts = gather_ranges(table, shard_ids, offsets, lengths, torch.from_numpy(payload))
    raw = payload.tobytes()  # one copy more, but slicing bytes is 2x faster than slicing a memoryview
    return [raw[a : a + n] for a, n in zip(starts.tolist(), lengths.tolist(), strict=True)]


def read_chunks(file: MappedFile, start: int, nbytes: int, chunk: int = 4 << 20) -> Iterator[memoryview]:
    """Bytes ``[start, start + nbytes)`` of ``file`` in pieces of at most ``chunk`` bytes. With the native
    module each piece is a guarded copy (a file truncated meanwhile raises :class:`fastio.CorruptShardError`);
    without it, views of the mapping after a size check.

    Example::

        crc = 0
        for piece in read_chunks(f, 0, f.size):
            crc = zlib.crc32(piece, crc)
    """
    file.check_size()
    if _native._C is None:
        view = memoryview(file.array)
        for at in range(start, start + nbytes, chunk):
            yield view[at : min(at + chunk, start + nbytes)]
        return
    table = MappedTable([file])
    scratch = torch.empty(min(chunk, nbytes), dtype=torch.uint8)
    one = np.zeros(1, dtype=np.int32)
    for at in range(start, start + nbytes, chunk):
        n = min(chunk, start + nbytes - at)
        gather_ranges(table, one, np.array([at], np.int64), np.array([n], np.int64), scratch[:n])
        yield memoryview(scratch.numpy())[:n]
