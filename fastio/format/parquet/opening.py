"""One call for a Parquet set with the reader's own settings (:func:`parquet_source`): local or at a URL,
with ``columns=``, a tokenizer for ``pack=`` on a text column, and the memory budget of decoded row groups.
``StreamLoader("data/train-*.parquet")`` opens the same set with every column (:mod:`fastio.registry`).

Example::

    source = parquet_source("data/", columns=["input_ids"])
    loader = fastio.StreamLoader(source, batch_size=8, pack=fastio.Pack("input_ids", seq_len=512))
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from fastio.format.parquet.decoded import DEFAULT_MEMORY
from fastio.format.parquet.remote import RemoteParquetSource
from fastio.format.parquet.source import ParquetSource
from fastio.format.parquet.tokens import Tokenizer
from fastio.remote.fetch import is_remote

__all__ = ["parquet_source"]


def parquet_source(
    target: str | os.PathLike[str] | Sequence[str],
    columns: Sequence[str] | None = None,
    *,
    tokenizer: Tokenizer | None = None,
    memory_limit: int = DEFAULT_MEMORY,
    cache_dir: str | os.PathLike[str] | None = None,
    cache_limit: int | str | None = None,
    storage_options: dict[str, Any] | None = None,
) -> ParquetSource | RemoteParquetSource:
    """A Parquet set as a batch source: a file, pattern, list or folder (local), or URLs (read through the
    node cache: only the footers and the selected columns' chunks of the row groups read).

    Args:
        target: where the files are.
        columns: the columns to read (default: every one); a column missing from a file raises
            :class:`fastio.SchemaMismatchError` naming the file and the column.
        tokenizer: ``tokenizer(list of str) -> list of token id lists``, for ``pack=`` on a text column.
        memory_limit: bytes of decoded row groups kept in memory (per process); a set larger than this is
            read row group by row group (``shuffle=True``: a sliding window of row groups).
        cache_dir, cache_limit, storage_options: remote sets only, as :class:`fastio.RemoteOptions`.

    Example::

        source = parquet_source("https://host/data/train-{00000..00003}-of-00004.parquet", ["text"],
                                cache_dir="/tmp/fastio-cache")
    """
    first = target[0] if isinstance(target, (list, tuple)) and target else target
    if is_remote(os.fspath(first) if isinstance(first, os.PathLike) else first):
        return RemoteParquetSource(
            target if isinstance(target, str) else list(target), columns, cache_dir, cache_limit,
            storage_options, memory_limit=memory_limit, tokenizer=tokenizer,
        )  # fmt: skip
    local = os.fspath(target) if isinstance(target, os.PathLike) else target
    return ParquetSource.local(
        local if isinstance(local, str) else list(local), columns, memory_limit, tokenizer
    )
