"""One Parquet row group as the shard of a batch source (:class:`RowGroup`): what a local set and the cached
units of a remote one both hand :class:`fastio.format.parquet.source.ParquetSource`.

Example::

    group = RowGroup("a.parquet", 0, 1000, 64_000, ("a.parquet", 0), lambda: pq.ParquetFile("a.parquet"))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable

import pyarrow.parquet as pq

__all__ = ["RowGroup"]


@dataclasses.dataclass(frozen=True)
class RowGroup:
    """One row group as a shard: which file (``name``, for errors), which group, its rows, the bytes its
    selected columns take decoded (an estimate from the footer), its key in the decoded cache, and
    ``reader()``, a ``pq.ParquetFile`` of the file for one read (pyarrow's readers are not for two threads
    at once).

    Example::

        RowGroup("a.parquet", 0, 1000, 64_000, ("a.parquet", 0), lambda: pq.ParquetFile("a.parquet"))
    """

    name: str
    index: int
    num_rows: int
    decoded_bytes: int
    key: Hashable
    reader: Callable[[], pq.ParquetFile]
