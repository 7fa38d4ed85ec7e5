"""Parquet row groups as the shards of a batch source (:class:`ParquetSource`), and the local files a set
is made of (:func:`local_row_groups`, :func:`open_parquet`, the registry's opener).

How a batch is made:

1. Every non-empty row group of every file, in file order, is a shard (``shard_sizes``): the unit the
   shard-aware orders permute and the ranks split, as a ``.tar`` or a fastio shard is.
2. :meth:`ParquetSource.fetch` decodes each row group the batch touches (only the selected columns, through
   ``pyarrow``, which reads just those column chunks) into :class:`~fastio.format.parquet.decoded.
   DecodedRowGroups`, kept while the memory budget allows, and cuts the batch from them: fixed columns
   copied into the loader's reused buffers, the others as lists.
3. Random access costs a row group's decode, so a set whose decoded row groups do not all fit
   ``memory_limit`` is read shard by shard (``requires_shard_order``): ``shuffle=True`` is then a sliding
   window over a permutation of row groups, as many as the budget holds (:meth:`ParquetSource.shards_held`),
   and ``shuffle="shard"`` is the explicit form. A set that fits takes any order (a full permutation, a
   sampler), each row group decoded once.

A file changed since it was opened (another size), or a row group pyarrow cannot decode, raises
:class:`fastio.CorruptShardError` naming the file and the row group; a null in a column the footer
statistics said had none, :class:`fastio.SchemaMismatchError`.

Example::

    source = ParquetSource.local("data/", columns=["input_ids", "label"])
    loader = fastio.StreamLoader(source, batch_size=32, shuffle=True, seed=0)
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from fastio.errors import CorruptShardError, EmptySourceError
from fastio.files.paths import expand_pattern
from fastio.format.parquet import PARQUET_SUFFIX, one_split, parquet_files_in
from fastio.format.parquet.decoded import DEFAULT_MEMORY, DecodedRowGroups
from fastio.format.parquet.footer import local_metadata
from fastio.format.parquet.layout import (
    ParquetLayout,
    check_same_schema,
    decide_layout,
    decode_columns,
    leaf_columns,
    null_free,
    select_columns,
)
from fastio.format.parquet.row_group import RowGroup
from fastio.format.parquet.tokens import Tokenizer, token_documents
from fastio.sources.base import Source, StageTimes, TokenDocuments
from fastio.sources.buffers import BatchBuffers

if TYPE_CHECKING:
    from fastio.options import OpenOptions

__all__ = ["ParquetSource", "decoded_estimate", "local_paths", "local_row_groups", "open_parquet", "plan_set"]


class _LocalFile:
    """A local file of a set: its footer, and the size and modification time it had when the set opened (a
    file that changed since is refused: its footer no longer describes it; one rewritten at the same size
    would be read through the old footer's offsets).

    :meth:`reader` opens the file anew for each call (about half a millisecond, against the milliseconds of
    decoding a row group): a ``pq.ParquetFile`` must not read from two threads at once (pyarrow crashes), and
    one kept per file would hold a descriptor per file of a set of thousands."""

    def __init__(self, path: str, meta: pq.FileMetaData) -> None:
        stat = os.stat(path)
        self.path, self.meta, self.size, self.mtime = path, meta, stat.st_size, stat.st_mtime_ns

    def reader(self) -> pq.ParquetFile:
        stat = os.stat(self.path) if os.path.exists(self.path) else None
        size = "no file" if stat is None else stat.st_size
        if size != self.size:
            raise CorruptShardError(
                self.path, "file size", f"{self.size} bytes (when the source opened)", size,
                "the file changed since; open the loader again",
            )  # fmt: skip
        if stat.st_mtime_ns != self.mtime:
            raise CorruptShardError(
                self.path, "modification time", f"{self.mtime} ns (when the source opened)", stat.st_mtime_ns,
                "the file was rewritten since, at the same size; open the loader again",
            )  # fmt: skip
        # No memory map: a file truncated under a mapping faults (SIGBUS) instead of raising.
        return pq.ParquetFile(self.path, metadata=self.meta, memory_map=False)


def local_paths(target: str | Sequence[str]) -> list[str]:
    """The files of a local set: a file, a glob or brace pattern, a list of them, or a folder (every
    ``.parquet`` file under it).

    Example::

        local_paths("data/")   # ["data/train-00000-of-00002.parquet", "data/train-00001-of-00002.parquet"]
    """
    if isinstance(target, str) and os.path.isdir(target):
        paths = one_split(target, parquet_files_in(target))
    else:
        paths = expand_pattern(target)
    if not paths:
        raise EmptySourceError(f"{target}: no {PARQUET_SUFFIX} file there")
    for path in paths:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{path}: no such Parquet file")
    return paths


def plan_set(
    names: Sequence[str], metas: Sequence[pq.FileMetaData], columns: Sequence[str] | None
) -> tuple[ParquetLayout, list[list[int]]]:
    """The layout of a set's ``columns`` (checked in every file: present, of one type) and each file's leaf
    column indices of them.

    Example::

        layout, leaves = plan_set(paths, [local_metadata(p) for p in paths], ["text"])
    """
    schemas = [meta.schema.to_arrow_schema() for meta in metas]
    selected = select_columns(names[0], schemas[0], columns)
    for name, schema in zip(names[1:], schemas[1:], strict=True):
        check_same_schema(names[0], schemas[0], name, schema, selected)
    leaves = [leaf_columns(meta, selected) for meta in metas]

    def no_nulls(column: str) -> bool:
        return all(null_free(m, leaf_columns(m, [column])) for m in metas)

    return decide_layout(schemas[0], selected, no_nulls), leaves


def decoded_estimate(meta: pq.FileMetaData, group: int, leaves: Sequence[int]) -> int:
    """Bytes the ``leaves`` of a row group take decoded, estimated from the footer (uncompressed chunk
    sizes, plus 8 bytes a row for offsets)."""
    row_group = meta.row_group(group)
    return sum(row_group.column(c).total_uncompressed_size for c in leaves) + 8 * row_group.num_rows


def local_row_groups(
    target: str | Sequence[str], columns: Sequence[str] | None
) -> tuple[list[RowGroup], ParquetLayout, str]:
    """The non-empty row groups of a local set, its layout and its name.

    Example::

        groups, layout, name = local_row_groups("data/", ["text"])
    """
    paths = local_paths(target)
    files = [_LocalFile(p, local_metadata(p)) for p in paths]
    layout, leaves = plan_set(paths, [f.meta for f in files], columns)
    groups = [
        RowGroup(
            f.path, g, f.meta.row_group(g).num_rows, decoded_estimate(f.meta, g, lv), (f.path, g), f.reader
        )
        for f, lv in zip(files, leaves, strict=True)
        for g in range(f.meta.num_row_groups)
        if f.meta.row_group(g).num_rows
    ]
    name = paths[0] if len(paths) == 1 else f"{paths[0]} (+{len(paths) - 1})"
    return groups, layout, name


class ParquetSource(Source):
    """Row groups of Parquet files as a batch source (see the module docstring).

    Args:
        row_groups: the shards, in order (:func:`local_row_groups`, or a remote source's cached ones).
        layout: how each selected column comes out (:class:`~fastio.format.parquet.layout.ParquetLayout`).
        name: what errors and progress bars call it.
        decoded: the decoded row groups (shared by the local sources of one remote source); default: its own,
            of ``memory_limit`` bytes.
        memory_limit: bytes of decoded row groups kept; the set is read shard by shard past it.
        tokenizer: for ``pack=`` on a text column: ``tokenizer(list of str) -> list of int sequences``.

    Example::

        source = ParquetSource.local("data/train-*.parquet", columns=["input_ids"])
        loader = fastio.StreamLoader(source, batch_size=8, pack=fastio.Pack("input_ids", seq_len=128))
    """

    per_sample = False
    DECODE_AHEAD = 2  # row groups decoded ahead of the one a pass reads

    def __init__(
        self,
        row_groups: Sequence[RowGroup],
        layout: ParquetLayout,
        name: str,
        decoded: DecodedRowGroups | None = None,
        memory_limit: int = DEFAULT_MEMORY,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        self.row_groups, self.layout, self.name, self.tokenizer = list(row_groups), layout, name, tokenizer
        self.decoded = decoded if decoded is not None else DecodedRowGroups(memory_limit)
        self.memory_limit = memory_limit
        self.shard_sizes = [g.num_rows for g in self.row_groups]
        self.num_samples = int(sum(self.shard_sizes))
        self.cumulative = np.concatenate([[0], np.cumsum(self.shard_sizes)]).astype(np.int64)
        self.requires_shard_order = sum(g.decoded_bytes for g in self.row_groups) > memory_limit
        self._columns = list(layout.columns)
        self._next: dict[int, list[int]] = {}  # a row group -> those the pass reads after it (decoded ahead)

    @classmethod
    def local(
        cls,
        target: str | Sequence[str],
        columns: Sequence[str] | None = None,
        memory_limit: int = DEFAULT_MEMORY,
        tokenizer: Tokenizer | None = None,
    ) -> ParquetSource:
        """A local set: a file, a pattern, a list of files or a folder of them (see :func:`local_paths`).

        Example::

            source = ParquetSource.local("data/", columns=["text", "label"])
        """
        groups, layout, name = local_row_groups(target, columns)
        return cls(groups, layout, name, memory_limit=memory_limit, tokenizer=tokenizer)

    def fixed_specs(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        return self.layout.fixed_specs()

    def shards_held(self) -> int | None:
        """Row groups the memory budget holds decoded at once (the largest ones); None: every one."""
        if not self.requires_shard_order:
            return None
        sizes = sorted((g.decoded_bytes for g in self.row_groups), reverse=True)
        held = int(np.searchsorted(np.cumsum(sizes), self.memory_limit, side="right"))
        return max(1, held)

    def stats(self) -> dict[str, Any]:
        """``row_groups_decoded`` (by this process) and ``decoded_bytes`` (kept now)."""
        return {"row_groups_decoded": self.decoded.decodes, "decoded_bytes": self.decoded.bytes}

    def prepare(self, shard_order: np.ndarray, epoch: int, indices: np.ndarray | None = None) -> None:
        """The pass's row group order: each decoded row group starts the decode of the next ones, as many as
        the memory budget holds beside the two a batch may span (at most ``DECODE_AHEAD``)."""
        held = self.shards_held()
        ahead = self.DECODE_AHEAD if held is None else max(0, min(self.DECODE_AHEAD, held - 2))
        order = [int(s) for s in shard_order]
        self._next = {s: order[i + 1 : i + 1 + ahead] for i, s in enumerate(order)} if ahead else {}

    def _decode(self, shard: int) -> dict[str, Any]:
        columns = self.decoded.get(self.row_groups[shard].key, self._decoder(shard))
        for later in self._next.get(shard, ()):
            self.decoded.prefetch(self.row_groups[later].key, self._decoder(later))
        return columns

    def _decoder(self, shard: int) -> Callable[[], dict[str, Any]]:
        group = self.row_groups[shard]

        def decode() -> dict[str, Any]:
            reader = group.reader()
            try:
                table = reader.read_row_group(group.index, columns=self._columns)
            except (pa.ArrowException, OSError) as exc:
                raise CorruptShardError(
                    group.name,
                    f"row group {group.index}",
                    "a row group pyarrow can decode",
                    f"{type(exc).__name__}: {exc}",
                ) from None
            if table.num_rows != group.num_rows:
                raise CorruptShardError(
                    group.name, f"row group {group.index}", f"{group.num_rows} rows", table.num_rows
                )
            return decode_columns(table, self.layout, group.name, group.index)

        return decode

    def fetch(
        self, indices: np.ndarray, buffers: BatchBuffers, threads: int, times: StageTimes
    ) -> dict[str, Any]:
        """The batch of ``indices``: their row groups decoded (or kept), then each column cut from them."""
        start = time.perf_counter()
        indices = np.asarray(indices, dtype=np.int64)
        span = (indices.min(), indices.max()) if len(indices) else (0, 0)
        ends = np.searchsorted(self.cumulative, span, side="right") - 1
        if len(indices) and ends[0] == ends[1]:  # one row group (a file-order read): no grouping of rows
            shard = int(ends[0])
            decoded = {shard: self._decode(shard)}
            picks: list[Pick] = [(shard, slice(None), _run(indices - self.cumulative[shard]))]
        else:
            shard_of = np.searchsorted(self.cumulative, indices, side="right") - 1
            shards = np.unique(shard_of)
            if self.shards_held() is None:  # every row group fits: those of this batch decode side by side
                for s in shards[1:]:
                    self.decoded.prefetch(self.row_groups[int(s)].key, self._decoder(int(s)))
            decoded = {int(s): self._decode(int(s)) for s in shards}
            picks = _picks(shard_of, indices - self.cumulative[shard_of], shards)
        decode_done = time.perf_counter()
        batch: dict[str, Any] = {}
        for column in self.layout.fixed:
            out = buffers.fixed(column, len(indices))
            target = out.numpy()
            for shard, where, rows in picks:
                target[where] = decoded[shard][column][rows]
            batch[column] = out
        for column in self.layout.arrays:
            batch[column] = _array_rows(column, decoded, picks, len(indices))
        for column in self.layout.objects:
            batch[column] = _object_rows(column, decoded, picks, len(indices))
        nbytes = sum(batch[c].numel() * batch[c].element_size() for c in self.layout.fixed)
        times.add("read", decode_done - start, nbytes)
        times.add("decode_transform", time.perf_counter() - decode_done)
        return batch

    @property
    def selected_columns(self) -> list[str]:
        """The columns read (what ``read=ReadOptions(columns=...)`` asked, or every one)."""
        return list(self.layout.columns)

    def token_documents(self, field_name: str) -> TokenDocuments:
        """The documents of a column of integer lists (or, with ``tokenizer=``, of strings), for ``pack=``
        (:mod:`fastio.format.parquet.tokens`).

        Example::

            docs = ParquetSource.local("data/").token_documents("input_ids")
        """
        threads = min(4, os.cpu_count() or 1)
        local = all(os.path.isfile(g.name) for g in self.row_groups)
        in_memory = sum(g.decoded_bytes for g in self.row_groups) <= self.memory_limit
        return token_documents(
            self.row_groups, self.layout, self.name, field_name, self.tokenizer, self, threads, keep=local,
            in_memory=in_memory,
        )  # fmt: skip


def _run(rows: np.ndarray) -> np.ndarray | slice:
    """``rows`` as a slice when they are consecutive (a file-order read: one slice copy per column)."""
    n = len(rows)
    if n and rows[-1] - rows[0] == n - 1 and (n < 3 or bool((rows[1:] - rows[:-1] == 1).all())):
        return slice(int(rows[0]), int(rows[0]) + n)
    return rows


def _listed(rows: np.ndarray | slice) -> list[int] | range:
    return range(rows.start, rows.stop) if isinstance(rows, slice) else rows.tolist()


Pick = tuple[int, Any, Any]  # (row group, positions in the batch, rows in the row group): slices or arrays


def _picks(shard_of: np.ndarray, rows: np.ndarray, shards: np.ndarray) -> list[Pick]:
    """Where each row group's rows go in the batch (grouped by one sort) and which rows they are."""
    if len(shards) == 1:
        return [(int(shards[0]), slice(None), _run(rows))]
    order = np.argsort(shard_of, kind="stable")
    groups = np.split(order, np.searchsorted(shard_of[order], shards, side="right")[:-1])
    return [(int(s), where, _run(rows[where])) for s, where in zip(shards, groups, strict=True)]


def _array_rows(column: str, decoded: dict[int, dict[str, Any]], picks: list[Pick], size: int) -> list[Any]:
    """A variable-length numeric column's rows as 1-D tensors viewing the decoded values (None: null)."""
    values: list[Any] = [None] * size
    for shard, where, rows in picks:
        offsets, flat, valid = decoded[shard][column]
        positions = range(size) if isinstance(where, slice) else where.tolist()
        for at, row in zip(positions, _listed(rows), strict=True):
            if valid[row]:
                values[at] = torch.from_numpy(flat[offsets[row] : offsets[row + 1]])
    return values


def _object_rows(column: str, decoded: dict[int, dict[str, Any]], picks: list[Pick], size: int) -> list[Any]:
    """Any other column's rows as Python values (pyarrow's ``to_pylist``)."""
    found: list[Any] = [None] * size
    for shard, where, rows in picks:
        array = decoded[shard][column]
        if isinstance(rows, slice):
            taken = array.slice(rows.start, rows.stop - rows.start).to_pylist()
        else:
            taken = array.take(pa.array(rows)).to_pylist()
        if isinstance(where, slice):
            return taken
        for at, value in zip(where.tolist(), taken, strict=True):
            found[at] = value
    return found


def open_parquet(target: str | list[str], options: OpenOptions) -> ParquetSource:
    """The registry's opener of local Parquet data (``options.columns``: ``read=ReadOptions(columns=...)``,
    default every column; for a tokenizer or another memory budget:
    :func:`fastio.format.parquet.opening.parquet_source`).

    Example::

        source = open_parquet("data/train-*.parquet", OpenOptions(columns=("input_ids",)))
    """
    return ParquetSource.local(target, options.columns)
