"""A Parquet column as the documents of ``pack=`` (:func:`token_documents`): a column of integer lists
(``input_ids``), or a text column with a tokenizer. The packer gathers tokens from mapped files, and a
Parquet page is compressed and encoded, so the column is decoded once, row group by row group, into one
flat token file per Parquet file (in a folder of its own under the cache directory, removed with the
source); each row is one document.

Example::

    source = ParquetSource.local("data/", tokenizer=lambda texts: tok(texts)["input_ids"])
    docs = source.token_documents("text")
"""

from __future__ import annotations

import collections
import concurrent.futures
import os
import shutil
import tempfile
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from fastio.errors import SchemaMismatchError
from fastio.files.mapped import MappedFile, MappedTable
from fastio.files.paths import default_cache_dir
from fastio.sources.base import TokenDocuments

if TYPE_CHECKING:
    from fastio.format.parquet.layout import ParquetLayout
    from fastio.format.parquet.row_group import RowGroup

__all__ = ["Tokenizer", "token_documents"]

Tokenizer = Callable[[list[str]], Sequence[Sequence[int]]]
_EXPECTED = "a column of integer lists (e.g. input_ids), or a string column with tokenizer="


def _column_tokens(
    chunk: pa.Array, name: str, field: str, group: int, tokenizer: Tokenizer | None
) -> tuple[np.ndarray, np.ndarray]:
    """(token counts per row, the row group's tokens back to back) of one decoded row group's column."""
    kind = chunk.type
    where = f"{field} (row group {group})"
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        if not pa.types.is_integer(kind.value_type):
            raise SchemaMismatchError(name, field, _EXPECTED, str(kind))
        if chunk.null_count:
            raise SchemaMismatchError(
                name, where, "a token list in every row", f"{chunk.null_count} null rows"
            )
        offsets = chunk.offsets.to_numpy().astype(np.int64)
        values = chunk.flatten()
        if values.null_count:
            raise SchemaMismatchError(name, where, "tokens without nulls", f"{values.null_count} null tokens")
        return np.diff(offsets), values.to_numpy(zero_copy_only=False)
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        if tokenizer is None:
            raise SchemaMismatchError(
                name, field, _EXPECTED, f"{kind} without a tokenizer: pass ParquetSource(..., tokenizer=f), "
                "f(list of str) -> list of token id lists"
            )  # fmt: skip
        texts = ["" if t is None else t for t in chunk.to_pylist()]
        encoded = [np.asarray(ids, dtype=np.int64) for ids in tokenizer(texts)]
        if len(encoded) != len(texts):
            raise ValueError(f"the tokenizer returned {len(encoded)} token lists for {len(texts)} texts")
        counts = np.array([len(ids) for ids in encoded], dtype=np.int64)
        flat = np.concatenate(encoded) if encoded else np.zeros(0, np.int64)
        if len(flat) and (flat.min() < np.iinfo(np.int32).min or flat.max() > np.iinfo(np.int32).max):
            raise SchemaMismatchError(name, where, "token ids that fit int32", f"{flat.min()}..{flat.max()}")
        return counts, flat.astype(np.int32)
    raise SchemaMismatchError(name, field, _EXPECTED, str(kind))


def _decoded(
    groups: Iterable[RowGroup], field: str, tokenizer: Tokenizer | None, threads: int
) -> Iterator[tuple[RowGroup, np.ndarray, np.ndarray]]:
    """Each row group with its column's (token counts, tokens), in order; ``threads`` > 1 decodes that many
    row groups ahead at once (pyarrow decodes without the GIL)."""

    def decode(group: RowGroup) -> tuple[RowGroup, np.ndarray, np.ndarray]:
        column = group.reader().read_row_group(group.index, columns=[field]).column(field)
        chunk = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
        return (group, *_column_tokens(chunk, group.name, field, group.index, tokenizer))

    if threads <= 1:
        yield from map(decode, groups)
        return
    with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="fastio-tokens") as pool:
        ahead: collections.deque[concurrent.futures.Future] = collections.deque()
        for group in groups:
            ahead.append(pool.submit(decode, group))
            if len(ahead) > threads:
                yield ahead.popleft().result()
        while ahead:
            yield ahead.popleft().result()


def token_documents(
    groups: Iterable[RowGroup], layout: ParquetLayout, name: str, field: str, tokenizer: Tokenizer | None,
    owner: object, threads: int = 1,
) -> TokenDocuments:  # fmt: skip
    """The rows of ``field`` in ``groups`` (a set's row groups, in order) as token documents (see the module
    docstring); the token files go with ``owner``. ``threads``: row groups decoded at once (1: each read
    while the iteration stands on it, what a remote source's pins need).

    Example::

        docs = token_documents(source.row_groups, source.layout, source.name, "input_ids", None, source)
        print(int(docs.tokens.sum()), "tokens")
    """
    if field not in layout.columns:
        raise SchemaMismatchError(name, field, _EXPECTED, f"no such column (read: {list(layout.columns)})")
    base = default_cache_dir() / "parquet-tokens"
    base.mkdir(parents=True, exist_ok=True)
    folder = tempfile.mkdtemp(prefix="tokens-", dir=base)
    weakref.finalize(owner, shutil.rmtree, folder, True)
    files: list[MappedFile] = []
    shard, src, counts = [], [], []
    dtype: np.dtype | None = None
    current: tuple[str, Any] | None = None  # (file name, open token file)
    written = 0
    for group, lengths, flat in _decoded(groups, field, tokenizer, threads):
        if current is None or current[0] != group.name:
            if current is not None:
                current[1].close()
                files.append(MappedFile(current[1].name))
            current = (group.name, open(os.path.join(folder, f"{len(files):06d}.tokens"), "wb"))
            written = 0
        if dtype is not None and flat.dtype != dtype:
            raise SchemaMismatchError(group.name, field, f"{dtype} tokens (as before)", str(flat.dtype))
        dtype = flat.dtype
        starts = written + np.concatenate([[0], np.cumsum(lengths)[:-1]]) * dtype.itemsize
        shard.append(np.full(len(lengths), len(files), dtype=np.int32))
        src.append(starts.astype(np.int64))
        counts.append(lengths)
        current[1].write(memoryview(np.ascontiguousarray(flat)).cast("B"))
        written += flat.nbytes
    if current is not None:
        current[1].close()
        files.append(MappedFile(current[1].name))
    assert dtype is not None  # a source holds at least one row group
    return TokenDocuments(
        np.concatenate(shard), np.concatenate(src), np.concatenate(counts), np.dtype(dtype).newbyteorder("="),
        MappedTable(files), _no_checksums,
    )  # fmt: skip


def _no_checksums(shard_ids: np.ndarray) -> None:
    """The token files were written by this process from decoded pages: nothing to verify."""
