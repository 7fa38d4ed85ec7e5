"""A fastio shard directory at a URL, read through the node-local shard cache (:mod:`fastio.remote`): the
format's half of a remote source (what the shards are, how a download is checked, the local source that
reads the cached files); :func:`open_remote_shards` is its opener in :mod:`fastio.registry`.

Example::

    source = RemoteShardSource("http://127.0.0.1:8000/train", cache_dir="/tmp/fastio-cache")
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import zlib
from pathlib import Path
from typing import Any

import torch

from fastio.errors import CorruptShardError, SchemaMismatchError
from fastio.format.shards.parts import PartReader, RemoteHead, fetch_head, part_ranges
from fastio.format.shards.reader import ShardReader, ShardSet
from fastio.format.shards.schema import Schema, schema_from_json
from fastio.format.shards.source import ShardSource, fixed_specs_of
from fastio.remote.base import RemoteSource
from fastio.remote.cache import ShardCache
from fastio.remote.fetch import (
    RetryPolicy,
    read_bytes,
    redact,
)
from fastio.remote.identity import remote_object
from fastio.remote.parts import choose_parts, part_bounds, part_key, parts_of
from fastio.remote.shard import Shard, cache_key
from fastio.sources.base import ShardParts

__all__ = ["RemoteShardSource", "open_remote_shards"]


class RemoteShardSource(RemoteSource):
    """A fastio shard directory at a URL (``<url>/index.json`` and the shard files it lists), read through
    the shard cache (see the module docstring). Each download is checked against ``index.json``'s
    ``file_nbytes`` (and a ``crc32`` or ``sha256`` there, when the writer put one) and the shard's own header
    before it becomes visible; the sections' crc32 are checked once per process on first read, as for local
    shards (``verify``).

    Args:
        url: the directory's URL (``s3://bucket/train/``, ``http://host/train``).
        cache_dir, cache_limit: the node-local cache (:class:`fastio.remote.cache.ShardCache`).
        storage_options: fsspec options.
        retry: :class:`fastio.remote.fetch.RetryPolicy` of every remote read.
        verify: as :class:`fastio.StreamLoader`'s ``verify``.
        download_threads, ahead: see :class:`RemoteSource`.

    Example::

        source = RemoteShardSource("http://127.0.0.1:8000/train", cache_dir="/tmp/fastio-cache")
        loader = fastio.StreamLoader(source, batch_size=64, shuffle="shard")
    """

    def __init__(
        self,
        url: str,
        cache_dir: str | os.PathLike[str] | None = None,
        cache_limit: int | str | None = None,
        storage_options: dict[str, Any] | None = None,
        retry: RetryPolicy | None = None,
        verify: bool | None = None,
        download_threads: int = 4,
        ahead: int = 8,
    ) -> None:
        root = url.rstrip("/")
        super().__init__(
            root, ShardCache(cache_dir, cache_limit), retry or RetryPolicy(), storage_options,
            download_threads, ahead,
        )  # fmt: skip
        self.verify = verify
        index_url = f"{root}/index.json"
        # The shards' cache entries are named after index.json's version (its ETag, Last-Modified... where the
        # store reports one) and each entry's checksum: a set written again at its URL (the writer always
        # writes its index last), even with shards of the same sizes, is never read from the cache stale.
        # The version is asked before the index is read: a set rewritten between the two then keys its new
        # entries under the old version, which no later open asks for, never old entries under the new one.
        index_version = remote_object(index_url, self.retry, self.storage_options).version
        raw = read_bytes(index_url, self.retry, self.storage_options)
        try:
            index = json.loads(raw)
        except ValueError as exc:
            raise CorruptShardError(redact(index_url), "index", "UTF-8 JSON", repr(exc)) from None
        if not isinstance(index, dict) or index.get("format") != "fastio-shards":
            found = index.get("format") if isinstance(index, dict) else type(index).__name__
            raise CorruptShardError(redact(index_url), "format", "fastio-shards", found)
        try:
            self.schema = schema_from_json(index.get("schema", {}))
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptShardError(
                redact(index_url), "schema", "{field: {kind, dtype, shape}}", repr(exc)
            ) from None
        entries = index.get("shards")
        if not isinstance(entries, list) or not entries:
            raise CorruptShardError(redact(index_url), "shards", "a non-empty list", repr(entries)[:80])
        self._checksums: list[dict[str, Any]] = []
        for i, entry in enumerate(entries):
            ok = isinstance(entry, dict) and isinstance(entry.get("file"), str)
            ok = ok and all(isinstance(entry.get(k), int) for k in ("num_samples", "file_nbytes"))
            name = entry.get("file", "") if isinstance(entry, dict) else ""
            if not ok or name.startswith("/") or ".." in name.split("/"):
                raise CorruptShardError(
                    redact(index_url),
                    f"shards[{i}]",
                    "{file (relative), num_samples, file_nbytes}",
                    repr(entry),
                )
            shard_url = f"{root}/{name}"
            size = entry["file_nbytes"]
            checksums = {k: entry[k] for k in ("crc32", "sha256") if k in entry}
            sums = (f"{k}={v}" for k, v in checksums.items())
            version = ";".join(v for v in (index_version, *sums) if v) or None
            key = cache_key(shard_url, name, version)
            self.shards.append(Shard(shard_url, key, size, size, entry["num_samples"]))
            self._checksums.append(checksums)
        self.shards_ready()
        self._files = list(self.shards)  # the whole shards, whichever units are read
        self._heads: list[RemoteHead] | None = None  # fetched by range at the first split
        self._part_of: dict[str, tuple[int, int, int]] = {}  # a part's cache key -> (shard, first, stop)

    def split_shards(self, reach: int | None, parts: int | None = None) -> ShardParts | None:
        """Parts of shards for ``shuffle=True`` under a cache that cannot hold every shard
        (:mod:`fastio.remote.parts` chooses how many; ``reach``: see
        :meth:`fastio.sources.Source.split_shards`); whole shards again for None, for a cache that holds
        every shard, and with ``verify=True`` (a part's bytes cannot be checked against its section's crc32);
        ``parts``: that many per shard, whatever the cache.

        Example::

            source.split_shards(reach=64)   # ShardParts(parts=8, window=31, part_samples=64, shards=16)
        """
        chosen = None
        if reach is not None and not self.verify:
            limit, resident = self.cache.limit, self.resident_bytes()
            chosen = choose_parts(self._files, limit, resident, reach, self._parts, parts)
        self._part_of = {} if chosen is None else parts_of(self._files, chosen)
        self.use_units(self._files if chosen is None else chosen[1])
        return None if chosen is None else chosen[0]

    def _parts(self, parts: int) -> list[Shard]:
        """Every non-empty part of every shard split into ``parts`` (:func:`part_bounds`), storage order."""
        if self._heads is None:
            with concurrent.futures.ThreadPoolExecutor(self.download_threads) as pool:
                heads = list(pool.map(self._head, range(len(self._files))))
            self._heads = heads
        units = []
        for shard, info in enumerate(self._files):
            for first, stop in part_bounds(info.num_samples, parts):
                ranges = part_ranges(self._heads[shard], first, stop)
                nbytes = sum(hi - lo for lo, hi in ranges)
                units.append(Shard(
                    info.url, part_key(info, first, stop), info.remote_size, nbytes, stop - first,
                    ranges=tuple((lo, hi) for lo, hi in ranges if hi > lo),
                ))  # fmt: skip
        return units

    def _head(self, shard: int) -> RemoteHead:
        """Shard ``shard``'s header and offsets (:func:`fetch_head`), checked against ``index.json``."""
        info = self._files[shard]
        head = fetch_head(info.url, info.remote_size, self.retry, self.storage_options)
        self._check_reader(shard, info.url, head.header.num_samples, head.header.schema)
        return head

    def fixed_specs(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        return fixed_specs_of(self.schema)

    def check_download(self, shard: int, part: Path) -> None:
        if self.shards[shard].key in self._part_of:
            return  # a part: its size is checked; index.json's checksums cover the whole file
        wanted = self._checksums[shard]
        if wanted:
            crc, sha = 0, hashlib.sha256()
            with open(part, "rb") as fh:
                while block := fh.read(1 << 22):
                    crc = zlib.crc32(block, crc)
                    sha.update(block)
            if "crc32" in wanted and crc != wanted["crc32"]:
                raise CorruptShardError(
                    self.shards[shard].url, "download", f"crc32 {wanted['crc32']:#010x}", f"crc32 {crc:#010x}"
                )
            if "sha256" in wanted and sha.hexdigest() != wanted["sha256"]:
                raise CorruptShardError(
                    self.shards[shard].url,
                    "download",
                    f"sha256 {wanted['sha256']}",
                    f"sha256 {sha.hexdigest()}",
                )
        ShardReader(part, verify=False)  # the header, sizes and sections: a wrong file never gets its name

    def open_shard(self, shard: int, path: Path) -> ShardReader | PartReader:
        part = self._part_of.get(self.shards[shard].key)
        if part is not None and self._heads is not None:
            source = redact(self.shards[shard].url)
            return PartReader(path, self._heads[part[0]], part[1], part[2], source=source)
        reader = ShardReader(path, verify=self.verify)
        self._check_reader(shard, str(path), reader.num_samples, reader.schema)
        return reader

    def _check_reader(self, shard: int, where: str, num_samples: int, schema: Schema) -> None:
        """Raise unless a shard's header agrees with ``index.json`` (its samples, its fields)."""
        info = self._files[shard]
        if num_samples != info.num_samples:
            raise CorruptShardError(where, "num_samples", f"{info.num_samples} (index.json)", num_samples)
        for name, field in self.schema.items():
            if schema.get(name) != field:
                found = schema[name].describe() if name in schema else "no such field"
                raise SchemaMismatchError(info.url, name, f"{field.describe()} (index.json)", found)

    def local_source(self, shards: tuple[int, ...], opened: list[Any]) -> ShardSource:
        return ShardSource(ShardSet.from_readers(self.name, self.schema, opened))


def open_remote_shards(url: str, options: Any) -> RemoteShardSource:
    """The registry's opener of a fastio shard directory at a URL (``options``: a
    :class:`fastio.options.OpenOptions`; its cache, storage and ``verify`` settings apply).

    Example::

        source = open_remote_shards("http://127.0.0.1:8000/train/", OpenOptions(cache_dir="/tmp/c"))
    """
    return RemoteShardSource(
        url,
        cache_dir=options.cache_dir,
        cache_limit=options.cache_limit,
        storage_options=dict(options.storage_options or {}),
        verify=options.verify,
    )
