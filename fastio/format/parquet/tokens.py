"""A Parquet column as the documents of ``pack=`` (:func:`token_documents`): a column of integer lists
(``input_ids``), or a text column with a tokenizer. The packer gathers tokens from mapped files, and a
Parquet page is compressed and encoded, so the column is decoded once, row group by row group, into one
flat token file per Parquet file; each row is one document.

Where the token files go:

1. A column of integer lists of local files: kept in the cache directory
   (``<cache_dir>/local/parquet-tokens/``, beside local copies of compressed tars: not counted against
   ``cache_limit``, never evicted), named by a digest of the file's path, size, modification time and
   footer, the column and the row groups, with the token count of every row beside them. The next loader
   over the same file (a restart, another rank of the node, the next job) maps them without decoding; a
   changed file gets new ones.
2. Otherwise (a tokenizer's output, a remote set): a folder of the source's own, removed with it.

Example::

    source = ParquetSource.local("data/", tokenizer=lambda texts: tok(texts)["input_ids"])
    docs = source.token_documents("text")
"""

from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import itertools
import logging
import mmap
import os
import queue
import shutil
import tempfile
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import torch

from fastio.errors import SchemaMismatchError
from fastio.files.mapped import MappedFile, MappedTable
from fastio.files.paths import LOCAL_COPIES, default_cache_dir
from fastio.format.parquet.footer import footer_length
from fastio.sources.base import TokenDocuments

if TYPE_CHECKING:
    from fastio.format.parquet.layout import ParquetLayout
    from fastio.format.parquet.row_group import RowGroup

__all__ = ["Tokenizer", "kept_tokens_path", "token_documents"]

Tokenizer = Callable[[list[str]], Sequence[Sequence[int]]]
_EXPECTED = "a column of integer lists (e.g. input_ids), or a string column with tokenizer="
Decoded = tuple["RowGroup", np.ndarray, np.ndarray]
_log = logging.getLogger(__name__)


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
) -> Iterator[Decoded]:
    """Each row group with its column's (token counts, tokens), in order; ``threads`` > 1 decodes that many
    row groups ahead at once (pyarrow decodes without the GIL)."""

    def decode(group: RowGroup) -> Decoded:
        # One column: pyarrow's own threads would only contend with this pool's.
        read = group.reader().read_row_group(group.index, columns=[field], use_threads=threads <= 1)
        column = read.column(field)
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


def kept_tokens_path(path: str, field: str, row_groups: Sequence[int]) -> Path:
    """Where the token file of ``field`` in ``row_groups`` of the local Parquet file ``path`` is kept (see the
    module docstring); its row counts are at the same path plus ``.counts.npy``.

    Example::

        kept_tokens_path("data/train-00000-of-00004.parquet", "input_ids", [0, 1, 2])
    """
    stat = os.stat(path)
    with open(path, "rb") as fh:
        fh.seek(max(0, stat.st_size - 8))
        length = footer_length(path, fh.read(8), stat.st_size)
        fh.seek(stat.st_size - 8 - length)
        footer = fh.read(length)
    identity = f"{os.path.abspath(path)}|{stat.st_size}|{stat.st_mtime_ns}|{field}|{list(row_groups)}"
    digest = hashlib.sha256(identity.encode() + footer).hexdigest()[:32]
    return default_cache_dir() / LOCAL_COPIES / "parquet-tokens" / f"{digest}.tokens"


def _kept(path: Path, dtype: np.dtype) -> np.ndarray | None:
    """The row counts of a kept token file, or None when it is not there whole."""
    try:
        counts = np.load(f"{path}.counts.npy")
        whole = path.stat().st_size == int(counts.sum()) * dtype.itemsize
    except (OSError, ValueError):
        return None
    return counts if whole else None


def _write(decoded: Iterable[Decoded], path: Path, keep_counts: bool, direct: bool = False) -> np.ndarray:
    """Write the tokens of one file's decoded row groups to ``path`` (through a temporary name); their row
    counts (also beside it, when kept). ``direct``: ``decoded`` is a list, written past the page cache where
    the system allows (:func:`_write_direct`), else as a plain write."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    counts: list[np.ndarray] = []
    if direct and _write_direct(tmp, [flat for _, _, flat in decoded]):
        counts = [lengths for _, lengths, _ in decoded]
    else:
        with open(tmp, "wb") as out:
            for _, lengths, flat in decoded:
                out.write(memoryview(np.ascontiguousarray(flat)).cast("B"))
                counts.append(lengths)
    rows = np.concatenate(counts).astype(np.int64)
    if keep_counts:
        counts_tmp = Path(f"{tmp}.counts.npy")
        np.save(counts_tmp, rows)
        os.replace(counts_tmp, f"{path}.counts.npy")
    os.replace(tmp, path)
    return rows


_BLOCK = 1 << 22  # bytes staged per O_DIRECT write: a multiple of any device block size


def _write_direct(path: Path, arrays: list[np.ndarray]) -> bool:
    """Write ``arrays`` back to back to the new file ``path`` with ``O_DIRECT`` (past the page cache: the
    kernel's copy into it costs about what decoding the tokens did, the copy into an aligned staging block a
    tenth of that); False when the system or filesystem refuses it (nothing kept), for a plain write."""
    direct = getattr(os, "O_DIRECT", 0)
    if not direct:
        return False
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | direct, 0o644)
    except OSError:
        return False
    block = mmap.mmap(-1, _BLOCK)  # page-aligned, as O_DIRECT needs
    staged, filled, size = np.frombuffer(block, np.uint8), 0, 0
    try:
        for array in arrays:
            raw = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
            at = 0
            while at < len(raw):
                take = min(_BLOCK - filled, len(raw) - at)
                staged[filled : filled + take] = raw[at : at + take]
                filled, at = filled + take, at + take
                if filled == _BLOCK:
                    size += _flush(fd, block, filled)
                    filled = 0
        if filled:
            size += _flush(fd, block, filled)
        os.ftruncate(fd, size)  # the last block went out padded
    except OSError:
        os.close(fd)
        os.unlink(path)
        return False
    os.close(fd)
    return True


def _flush(fd: int, block: mmap.mmap, filled: int) -> int:
    """One staged block out, padded to the alignment O_DIRECT needs; the bytes of it that count."""
    padded = -(-filled // 4096) * 4096
    if os.write(fd, memoryview(block)[:padded]) != padded:  # a short direct write: take the plain way
        raise OSError(f"short O_DIRECT write of {padded} bytes")
    return filled


class _HeldTokens:
    """One row group's decoded tokens kept in memory, as an entry of the :class:`MappedTable` the packer's
    gathers read (what a :class:`MappedFile` offers them: its address, size and a size check)."""

    def __init__(self, name: str, group: int, flat: np.ndarray) -> None:
        self.path = f"{name} (row group {group}, decoded in memory)"
        self.array = np.ascontiguousarray(flat).view(np.uint8)
        self.size = self.array.nbytes
        self.address = int(self.array.ctypes.data) if self.size else 0

    @property
    def tensor(self) -> torch.Tensor:
        """The bytes as a tensor (read only; for the gathers without the native kernels)."""
        with warnings.catch_warnings():  # pyarrow's buffers are read only; nothing writes through this view
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(self.array)

    def current_size(self) -> int:
        return self.size

    def check_size(self) -> None:
        """Memory does not shrink: nothing to check."""


class _KeptWriter:
    """Writes kept token files from decoded row groups held in memory, in a background thread, each file as
    soon as its row groups are decoded (the next loader over the files needs them; this one reads its
    memory). :meth:`join` waits for the last."""

    def __init__(self) -> None:
        self._files: queue.SimpleQueue[tuple[Path, list[Decoded]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="fastio-kept-tokens")
        self._thread.start()

    def put(self, path: Path, decoded: list[Decoded]) -> None:
        self._files.put((path, decoded))

    def close(self) -> None:
        """No more files: the thread ends after writing those put."""
        self._files.put(None)

    def join(self) -> None:
        self._thread.join()

    def _run(self) -> None:
        while (item := self._files.get()) is not None:
            path, decoded = item
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                _write(decoded, path, keep_counts=True, direct=True)
            except OSError as error:  # the next loader decodes again; this one reads its memory
                _log.warning("fastio parquet: token file %s not kept (%s)", path, error)


def token_documents(
    groups: Iterable[RowGroup], layout: ParquetLayout, name: str, field: str, tokenizer: Tokenizer | None,
    owner: object, threads: int = 1, keep: bool = False, in_memory: bool = False,
) -> TokenDocuments:  # fmt: skip
    """The rows of ``field`` in ``groups`` (a set's row groups, in order) as token documents (see the module
    docstring). ``threads``: row groups decoded at once (1: each read while the iteration stands on it, what
    a remote source's pins need). ``keep``: the groups are of local files, whose token files are kept; else
    they go with ``owner``. ``in_memory``: the decoded tokens fit the memory budget: they are kept in memory
    and read from there (no token file written first; with ``keep``, the kept files are written in a
    background thread for the next loader).

    Example::

        docs = token_documents(source.row_groups, source.layout, source.name, "input_ids", None, source)
        print(int(docs.tokens.sum()), "tokens")
    """
    if field not in layout.columns:
        raise SchemaMismatchError(name, field, _EXPECTED, f"no such column (read: {list(layout.columns)})")
    kind = layout.type_of(field)
    listed = pa.types.is_list(kind) or pa.types.is_large_list(kind)
    dtype = np.dtype(kind.value_type.to_pandas_dtype()) if listed else np.dtype(np.int32)
    keep = keep and listed and tokenizer is None
    own: list[Path] = []

    def own_path() -> Path:
        if not own:
            base = default_cache_dir() / "parquet-tokens"
            base.mkdir(parents=True, exist_ok=True)
            own.append(Path(tempfile.mkdtemp(prefix="tokens-", dir=base)))
            weakref.finalize(owner, shutil.rmtree, own[0], True)
        return own[0] / f"{len(entries):06d}.tokens"

    entries: list[MappedFile | _HeldTokens] = []
    counts: list[np.ndarray] = []
    settle: Callable[[], None] = _nothing_to_settle

    def hold(items: Iterable[Decoded]) -> list[Decoded]:
        held = list(items)
        for group, lengths, flat in held:
            entries.append(_HeldTokens(group.name, group.index, flat.astype(dtype, copy=False)))
            counts.append(lengths.astype(np.int64, copy=False))
        return held

    if keep:
        runs = [(n, list(run)) for n, run in itertools.groupby(groups, key=lambda g: g.name)]
        paths = [kept_tokens_path(n, field, [g.index for g in run]) for n, run in runs]
        found = [_kept(p, dtype) for p in paths]
        todo = [g for (_, run), f in zip(runs, found, strict=True) if f is None for g in run]
        decoded = _decoded(todo, field, tokenizer, threads)
        writer = _KeptWriter() if in_memory and todo else None
        try:
            for (_, run), path, rows in zip(runs, paths, found, strict=True):
                if rows is None and writer is not None:
                    writer.put(path, hold(itertools.islice(decoded, len(run))))
                    continue
                if rows is None:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    rows = _write(itertools.islice(decoded, len(run)), path, keep_counts=True)
                entries.append(MappedFile(path))
                counts.append(rows)
        finally:
            if writer is not None:
                writer.close()
        if writer is not None:
            settle = writer.join
    elif in_memory:
        hold(_decoded(groups, field, tokenizer, threads))
    else:
        for _, items in itertools.groupby(
            _decoded(groups, field, tokenizer, threads), key=lambda t: t[0].name
        ):
            path = own_path()
            counts.append(_write(items, path, keep_counts=False))
            entries.append(MappedFile(path))
    shard = np.repeat(np.arange(len(counts), dtype=np.int32), [len(c) for c in counts])
    src = np.concatenate([np.concatenate([[0], np.cumsum(c)[:-1]]) * dtype.itemsize for c in counts])
    return TokenDocuments(
        shard, src.astype(np.int64), np.concatenate(counts), dtype.newbyteorder("="), MappedTable(entries),
        _no_checksums, settle,
    )  # fmt: skip


def _no_checksums(shard_ids: np.ndarray) -> None:
    """Token files are written whole (through a temporary name) and checked against their row counts."""


def _nothing_to_settle() -> None:
    """Every token file is written before the first batch."""
