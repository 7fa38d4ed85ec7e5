"""A Parquet file's footer: its metadata (schema, row groups, column chunks, statistics), read and checked,
from a local file or from the tail bytes of a remote one, and where a row group's column chunks lie.

A Parquet file ends with ``<footer><4-byte little-endian footer length>PAR1``. Anything else there (a file
cut short, bytes that are not Parquet, an encrypted footer, ``PARE``) is a :class:`fastio.CorruptShardError`
naming the file and what was found, never pyarrow's bare message.

Example::

    meta = local_metadata("data/train-00000-of-00004.parquet")
    ranges = chunk_ranges(meta, row_group=0, columns=[0, 1])   # [(4, 18230)]
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from fastio.errors import CorruptShardError

__all__ = ["MAGIC", "TAIL_BYTES", "chunk_ranges", "footer_length", "footer_metadata", "local_metadata"]

MAGIC = b"PAR1"
TAIL_BYTES = (
    64 << 10
)  # bytes read from a remote file's end at first: the footer of most files, in one request
_EXPECTED = "a Parquet footer (<metadata><length>PAR1 at the end)"


def footer_length(name: str, last: bytes, file_size: int) -> int:
    """The footer's length from a file's last 8 bytes, checked against the file's size.

    Example::

        n = footer_length("a.parquet", data[-8:], len(data))
    """
    if file_size < 12 or len(last) < 8:
        raise CorruptShardError(name, "footer", _EXPECTED, f"a file of {file_size} bytes")
    if last[-4:] == b"PARE":
        raise CorruptShardError(
            name, "footer", _EXPECTED, "an encrypted footer (PARE), which fastio cannot read"
        )
    if last[-4:] != MAGIC:
        raise CorruptShardError(name, "footer", _EXPECTED, f"{bytes(last[-4:])!r} at the end (cut short?)")
    length = int.from_bytes(last[-8:-4], "little")
    if length + 8 > file_size - 4:
        raise CorruptShardError(
            name, "footer", f"at most {file_size - 12} bytes of footer", f"{length} bytes"
        )
    return length


def footer_metadata(name: str, tail: bytes, file_size: int) -> pq.FileMetaData:
    """The metadata of a ``file_size``-byte file whose last bytes are ``tail`` (the footer and its length,
    at least), parsed without the rest of the file.

    Example::

        meta = footer_metadata(url, tail, size)
    """
    length = footer_length(name, tail[-8:], file_size)
    if len(tail) < length + 8:
        raise ValueError(f"{name}: {len(tail)} tail bytes hold no {length}-byte footer; read {length + 8}")
    return _parsed(name, lambda: pq.read_metadata(pa.BufferReader(tail[-(length + 8) :])))


def local_metadata(path: str) -> pq.FileMetaData:
    """The metadata of a local Parquet file (:class:`fastio.CorruptShardError` for a bad or missing footer).

    Example::

        meta = local_metadata("data/train-00000-of-00004.parquet")
    """
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        fh.seek(max(0, size - 8))
        footer_length(path, fh.read(8), size)
    return _parsed(path, lambda: pq.read_metadata(path))


def _parsed(name: str, read: Callable[[], pq.FileMetaData]) -> pq.FileMetaData:
    try:
        meta = read()
    except (pa.ArrowException, OSError) as exc:
        raise CorruptShardError(name, "footer", _EXPECTED, f"metadata pyarrow cannot parse ({exc})") from None
    for g in range(meta.num_row_groups):
        if meta.row_group(g).num_rows < 0:
            raise CorruptShardError(
                name, "footer", "row counts >= 0", f"row group {g}: {meta.row_group(g).num_rows}"
            )
    return meta


def chunk_ranges(meta: pq.FileMetaData, row_group: int, columns: Sequence[int]) -> list[tuple[int, int]]:
    """The byte ranges ``[start, stop)`` of the column chunks ``columns`` (leaf column indices) of
    ``row_group``, adjacent ones merged: what reading those columns of that row group touches.

    Example::

        chunk_ranges(meta, 0, [0, 2])   # [(4, 1200), (2500, 3900)]
    """
    group = meta.row_group(row_group)
    spans = []
    for c in columns:
        chunk = group.column(c)
        start = chunk.data_page_offset
        if chunk.has_dictionary_page and 0 < chunk.dictionary_page_offset < start:
            start = chunk.dictionary_page_offset
        spans.append((start, start + chunk.total_compressed_size))
    merged: list[tuple[int, int]] = []
    for start, stop in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(stop, merged[-1][1]))
        else:
            merged.append((start, stop))
    return merged
