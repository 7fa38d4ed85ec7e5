"""Parquet files at URLs, read through the node cache of :mod:`fastio.remote`: the format's half of a
remote source. Only the footer and the needed row groups' column chunks are fetched, by range.

1. Opening: per file, its size (one ``HEAD``) and its last :data:`~fastio.format.parquet.footer.TAIL_BYTES`
   (one ranged ``GET``; a second for a longer footer), parsed into its metadata; every file's selected
   columns are checked against the first's (:class:`fastio.SchemaMismatchError` naming the file and the
   column). The tail is kept in the cache (``<file>.footer``, counted against ``cache_limit``, never
   evicted): the next open of the same version of the file (its size, and its ETag, Last-Modified or
   the store's equivalent where the store reports one: :mod:`fastio.remote.identity`) reads it there, its
   ``HEAD`` the only request; a file republished at its URL is another cache entry, never read stale.
2. Each non-empty row group is a cache unit (:class:`fastio.remote.Shard` with ``ranges``): the byte ranges
   of its selected column chunks, fetched by range and kept back to back; the cache holds, evicts and
   counts them as it does parts of any shard.
3. A cached row group is read by pyarrow through :class:`CachedRowGroupFile`, a file object that answers
   reads at the remote file's offsets from the cache entry, and the footer from memory; a read outside them
   is an ``OSError`` naming the bytes, never wrong data.

Example::

    source = RemoteParquetSource("http://127.0.0.1:8000/data/train-{00000..00003}-of-00004.parquet",
                                 columns=["input_ids"], cache_dir="/tmp/fastio-cache", cache_limit="1GB")
"""

from __future__ import annotations

import bisect
import concurrent.futures
import contextlib
import functools
import hashlib
import io
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import torch

from fastio.errors import CorruptShardError
from fastio.format.parquet.decoded import DEFAULT_MEMORY, DecodedRowGroups
from fastio.format.parquet.footer import TAIL_BYTES, chunk_ranges, footer_length, footer_metadata
from fastio.format.parquet.row_group import RowGroup
from fastio.format.parquet.source import ParquetSource, decoded_estimate, plan_set
from fastio.format.parquet.tokens import Tokenizer, token_documents
from fastio.remote.base import RemoteSource
from fastio.remote.cache import ShardCache
from fastio.remote.fetch import (
    RemoteNotFoundError,
    RetryPolicy,
    cat_ranges,
    expand_urls,
    with_retries,
)
from fastio.remote.identity import RemoteObject, remote_object
from fastio.remote.shard import Shard, cache_key
from fastio.sources.base import TokenDocuments

__all__ = [
    "FOOTER_SUFFIX",
    "CachedRowGroupFile",
    "RemoteParquetSource",
    "open_remote_parquet",
    "remote_footer",
]

FOOTER_SUFFIX = ".footer"  # a file's kept tail in the cache: its size (8 bytes, little-endian), the tail


class CachedRowGroupFile(io.RawIOBase):
    """A remote Parquet file as pyarrow reads it, made of what is cached: the column chunks of one row group
    (``ranges`` of the remote file, back to back in ``path``) and the footer (``tail``, the file's last
    bytes). Reads elsewhere raise ``OSError``.

    Example::

        file = CachedRowGroupFile(path, [(4, 9000)], tail, size=20000, name=url)
        table = pq.ParquetFile(file, metadata=meta).read_row_group(0)
    """

    def __init__(
        self, path: Path, ranges: Sequence[tuple[int, int]], tail: bytes, size: int, name: str
    ) -> None:
        super().__init__()
        self._fh = open(path, "rb")  # noqa: SIM115 (closed with the file object)
        self._starts = [a for a, _ in ranges]
        self._spans, at = [], 0
        for start, stop in ranges:
            self._spans.append((start, stop, at))
            at += stop - start
        self._tail, self._size, self._name, self._pos = tail, size, name, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        base = (0, self._pos, self._size)[whence]
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def size(self) -> int:
        return self._size

    def close(self) -> None:
        self._fh.close()
        super().close()

    def read(self, n: int = -1) -> bytes:
        pos = self._pos
        stop = self._size if n < 0 else min(self._size, pos + n)
        if stop <= pos:
            return b""
        tail_start = self._size - len(self._tail)
        if pos >= tail_start:
            data = self._tail[pos - tail_start : stop - tail_start]
        else:
            i = bisect.bisect_right(self._starts, pos) - 1
            start, end, at = self._spans[i] if i >= 0 else (0, 0, 0)
            if not start <= pos or stop > end:
                raise OSError(f"{self._name}: bytes [{pos}, {stop}) are not among the cached column chunks")
            data = os.pread(self._fh.fileno(), stop - pos, at + pos - start)
            if len(data) != stop - pos:
                raise OSError(f"{self._name}: the cached row group is {len(data)} bytes short at {pos}")
        self._pos = stop
        return data

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)


def remote_footer(
    url: str, size: int, retry: RetryPolicy, storage_options: dict[str, Any]
) -> tuple[bytes, pq.FileMetaData]:
    """The last bytes of a remote file (at least its footer) and its metadata: one ranged read, two when the
    footer is longer than :data:`~fastio.format.parquet.footer.TAIL_BYTES`.

    Example::

        tail, meta = remote_footer(url, remote_size(url, RetryPolicy()), RetryPolicy(), {})
    """

    def tail_of(length: int) -> bytes:
        ranges = ((max(0, size - length), size),)
        return with_retries(lambda: cat_ranges(url, ranges, size, retry, storage_options), url, retry)[0][0]

    tail = tail_of(min(size, TAIL_BYTES))
    length = footer_length(url, tail[-8:], size)
    if length + 8 > len(tail):
        tail = tail_of(length + 8)
    return tail, footer_metadata(url, tail, size)


class RemoteParquetSource(RemoteSource):
    """Parquet files at URLs, read through the node cache by row group (see the module docstring). Batches
    are what :class:`~fastio.format.parquet.source.ParquetSource` gives over the same files.

    Args:
        urls: a URL, brace pattern or glob (``hf://datasets/org/name/data/train-*.parquet``), or a list.
        columns: the columns to read (default: every column of the first file); only their chunks are
            fetched.
        cache_dir, cache_limit, storage_options, retry, download_threads, ahead: as
            :class:`fastio.format.tar.remote.RemoteTarSource`.
        memory_limit, tokenizer: as :class:`~fastio.format.parquet.source.ParquetSource`.

    Example::

        source = RemoteParquetSource("s3://bucket/data/*.parquet", columns=["text"], cache_limit="20GB")
        loader = fastio.StreamLoader(source, batch_size=64, shuffle=True, seed=0)
    """

    def __init__(
        self,
        urls: str | Sequence[str],
        columns: Sequence[str] | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_limit: int | str | None = None,
        storage_options: dict[str, Any] | None = None,
        retry: RetryPolicy | None = None,
        memory_limit: int = DEFAULT_MEMORY,
        tokenizer: Tokenizer | None = None,
        download_threads: int = 4,
        ahead: int = 8,
    ) -> None:
        listed = expand_urls(urls, storage_options)
        if not listed:
            raise RemoteNotFoundError(str(urls), "the pattern names no file")
        name = listed[0] if len(listed) == 1 else f"{listed[0]} (+{len(listed) - 1})"
        super().__init__(
            name,
            ShardCache(cache_dir, cache_limit),
            retry or RetryPolicy(),
            storage_options,
            download_threads,
            ahead,
        )
        self.memory_limit, self.tokenizer = memory_limit, tokenizer
        self.decoded = DecodedRowGroups(memory_limit)
        with concurrent.futures.ThreadPoolExecutor(
            download_threads, thread_name_prefix="fastio-open"
        ) as pool:
            # one info request a file: its size, and its version (ETag, Last-Modified...) for the cache keys,
            # so that a file republished at its URL, even at the same size, is never read from the cache
            objects = list(pool.map(lambda url: remote_object(url, self.retry, self.storage_options), listed))
            footers = list(pool.map(self._footer, objects))
        self._tails = [tail for tail, _ in footers]
        self._metas = [meta for _, meta in footers]
        self.layout, leaves = plan_set(listed, self._metas, columns)
        digest = hashlib.sha256(repr(self.layout.columns).encode()).hexdigest()[:8]
        self._where: list[tuple[int, int]] = []  # per unit: (file, row group)
        for f, (obj, meta) in enumerate(zip(objects, self._metas, strict=True)):
            url = obj.url
            for g in range(meta.num_row_groups):
                rows = meta.row_group(g).num_rows
                if not rows:
                    continue
                ranges = tuple(chunk_ranges(meta, g, leaves[f]))
                key = cache_key(url, f"{url.rsplit('/', 1)[-1]}@rg{g}-{digest}", obj.version)
                local = sum(b - a for a, b in ranges)
                self.shards.append(Shard(url, key, obj.size, local, rows, ranges=ranges))
                self._where.append((f, g))
        self._estimates = [decoded_estimate(self._metas[f], g, leaves[f]) for f, g in self._where]
        self.shards_ready()

    def _footer(self, obj: RemoteObject) -> tuple[bytes, pq.FileMetaData]:
        """A file's footer (its last bytes) and metadata: kept in the cache by an earlier open of this
        version of the file, of this size (read there, no request), else fetched (:func:`remote_footer`)
        and kept, when the cache has room (a kept footer counts against ``cache_limit``, in
        :meth:`resident_bytes`)."""
        url, size = obj.url, obj.size
        key = cache_key(url, f"{url.rsplit('/', 1)[-1]}{FOOTER_SUFFIX}", obj.version)
        with contextlib.suppress(OSError, CorruptShardError):
            kept = self.cache.path(key).read_bytes()
            if int.from_bytes(kept[:8], "little") == size:  # of the file as it is now (its size)
                return kept[8:], footer_metadata(url, kept[8:], size)
        tail, meta = remote_footer(url, size, self.retry, self.storage_options)
        tail = tail[-(footer_length(url, tail[-8:], size) + 8) :]  # the footer itself: what pyarrow reads
        self.cache.keep(key, size.to_bytes(8, "little") + tail)
        return tail, meta

    def resident_bytes(self) -> int:
        """The kept footers' bytes: never evicted, counted against ``cache_limit``."""
        return sum(8 + len(tail) for tail in self._tails)

    def fixed_specs(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        return self.layout.fixed_specs()

    def open_shard(self, shard: int, path: Path) -> RowGroup:
        info = self.shards[shard]
        key = (info.key, os.stat(path).st_ino)
        reader = functools.partial(self._reader, shard, path)
        return RowGroup(
            info.url, self._where[shard][1], info.num_samples, self._estimates[shard], key, reader
        )

    def _reader(self, shard: int, path: Path) -> pq.ParquetFile:
        """A reader of the cached row group, for one read (a ``pq.ParquetFile`` is not for two threads)."""
        info, f = self.shards[shard], self._where[shard][0]
        assert info.ranges is not None  # every unit is ranges of its file
        opened = CachedRowGroupFile(path, info.ranges, self._tails[f], info.remote_size, info.url)
        # No pre-buffering: it coalesces chunks across small gaps, which a unit of some columns does not hold.
        return pq.ParquetFile(opened, metadata=self._metas[f], pre_buffer=False)

    def local_source(self, shards: tuple[int, ...], opened: list[RowGroup]) -> ParquetSource:
        return ParquetSource(opened, self.layout, self.name, self.decoded, self.memory_limit, self.tokenizer)

    @property
    def selected_columns(self) -> list[str]:
        """The columns read (what ``read=ReadOptions(columns=...)`` asked, or every one)."""
        return list(self.layout.columns)

    def token_documents(self, field_name: str) -> TokenDocuments:
        """The documents of a token (or text) column for ``pack=``: every row group is brought into the
        cache once, now, and its column decoded into token files (:mod:`fastio.format.parquet.tokens`).

        Example::

            docs = RemoteParquetSource(url, columns=["input_ids"]).token_documents("input_ids")
        """
        in_memory = sum(self._estimates) <= self.memory_limit
        return token_documents(
            self._held_groups(), self.layout, self.name, field_name, self.tokenizer, self, in_memory=in_memory
        )

    def _held_groups(self) -> Iterator[RowGroup]:
        """Every row group, each brought into the cache and pinned while the caller stands on it."""
        for shard in range(len(self.shards)):
            with self.cached(shard) as path:
                yield self.open_shard(shard, path)


def open_remote_parquet(target: str | list[str], options: Any) -> RemoteParquetSource:
    """The registry's opener of Parquet files at URLs (``options``: a :class:`fastio.options.OpenOptions`; its
    cache and storage settings and its ``columns`` apply).

    Example::

        source = open_remote_parquet("http://127.0.0.1:8000/data/*.parquet", OpenOptions(cache_dir="/c"))
    """
    return RemoteParquetSource(
        target, options.columns, cache_dir=options.cache_dir, cache_limit=options.cache_limit,
        storage_options=dict(options.storage_options or {}),
    )  # fmt: skip
