"""Parts of remote fastio shards (:mod:`fastio.remote.parts` says why and how many): where a part's samples
lie in its shard, and how its cached bytes are read.

1. :func:`fetch_head`: a shard's prefix and header, read by range and checked as a local shard's are
   (:func:`fastio.format.shards.header.read_header`), and every variable field's offsets array, checked
   against its crc32 and kept in memory (8 bytes per sample): a part's payload bytes are known from them
   before it is fetched, so the cache reserves its exact size.
2. :func:`part_ranges`: samples ``[first, stop)`` of a shard are one byte range per field (the rows of a
   fixed field, the payload of a variable one), after the shard's 32-byte prefix. A part's cache entry is
   those ranges back to back, in that order.
3. :class:`PartReader` reads such an entry as the shard readers read a whole shard (what
   :class:`fastio.format.shards.source.ShardSource` needs of a reader), after checking its size and its
   prefix against the one read with the header (the prefix holds the file's size and the header's crc32:
   a shard rewritten since the header was read is refused, not read at the old offsets).

What is not checked: a section's crc32 covers the whole section, so a part's bytes are not checksummed (the
header, the offsets and every size are; a short or missing range raises). ``verify=True`` therefore keeps
whole shards (:meth:`fastio.format.shards.remote.RemoteShardSource.split_shards`).

Example::

    head = fetch_head(url, size, RetryPolicy(), {})
    ranges = part_ranges(head, 0, 64)
"""

from __future__ import annotations

import dataclasses
import functools
import os
import zlib
from typing import Any

import numpy as np

from fastio.errors import CorruptShardError
from fastio.files.mapped import MappedFile
from fastio.format.shards.header import ShardHeader, check_offsets, read_header
from fastio.format.shards.layout import PREFIX
from fastio.remote.fetch import RetryPolicy, cat_ranges, with_retries

__all__ = ["PartReader", "RemoteHead", "fetch_head", "part_ranges"]


@dataclasses.dataclass(frozen=True)
class RemoteHead:
    """A remote shard's checked header, its prefix's bytes and each variable field's offsets (int64
    ``[N + 1]``)."""

    header: ShardHeader
    prefix: bytes
    offsets: dict[str, np.ndarray]


def fetch_head(url: str, size: int, retry: RetryPolicy, storage_options: dict[str, Any]) -> RemoteHead:
    """The header and offsets of the ``size``-byte shard at ``url``, read by range under ``retry`` (see the
    module docstring); :class:`fastio.CorruptShardError` when any is wrong.

    Example::

        head = fetch_head("http://127.0.0.1:8000/train/shard-000000.fio", 4096, RetryPolicy(), {})
    """

    seen: dict[tuple[int, int], bytes] = {}

    def read(start: int, stop: int) -> bytes:
        if stop <= start:
            return b""
        call = functools.partial(cat_ranges, url, [(start, stop)], size, retry, storage_options)
        seen[start, stop] = with_retries(call, url, retry)[0][0]
        return seen[start, stop]

    header = read_header(url, size, read)
    prefix = seen[0, PREFIX.size]
    offsets = {}
    for name, field in header.schema.items():
        if field.kind == "fixed":
            continue
        start, nbytes, crc = header.sections[name]["offsets"]
        raw = read(start, start + nbytes)
        if zlib.crc32(raw) != crc:
            found = f"crc32 {zlib.crc32(raw):#010x}"
            raise CorruptShardError(url, f"{name}.offsets", f"crc32 {crc:#010x}", found)
        offsets[name] = np.frombuffer(raw, dtype=np.int64).copy()
        check_offsets(url, name, offsets[name], header.sections[name]["data"][1])
    return RemoteHead(header, prefix, offsets)


def part_ranges(head: RemoteHead, first: int, stop: int) -> list[tuple[int, int]]:
    """The shard's prefix, then the byte range of samples ``[first, stop)`` of each field, in schema order (an
    empty one where a variable field's samples there are all empty).

    Example::

        [prefix, (a, b)] = part_ranges(head, 0, 8)   # a schema of one fixed field: its first 8 rows
    """
    ranges = [(0, PREFIX.size)]
    for name, field in head.header.schema.items():
        start = head.header.sections[name]["data"][0]
        if field.kind == "fixed":
            lo, hi = first * field.row_nbytes, stop * field.row_nbytes
        else:
            lo, hi = int(head.offsets[name][first]), int(head.offsets[name][stop])
        ranges.append((start + lo, start + hi))
    return ranges


class PartReader:
    """Samples ``[first, stop)`` of a shard, cached at ``path`` as :func:`part_ranges` lists them: the reader
    :class:`fastio.format.shards.source.ShardSource` reads it through (``file``, ``num_samples``, ``schema``,
    ``sections``, :meth:`variable_layout`, :meth:`ensure_verified`). Raises
    :class:`fastio.CorruptShardError` when the file is not the size the ranges add up to, naming ``source``
    (the remote shard, without credentials) when given, else the cached file.

    Example::

        reader = PartReader(cache.path(key), head, 64, 128, source="http://host/train/shard-000004.fio")
    """

    def __init__(
        self, path: str | os.PathLike[str], head: RemoteHead, first: int, stop: int, source: str | None = None
    ) -> None:
        self.path = str(path)
        named = f"{source} (cached at {self.path})" if source else self.path
        self.file = MappedFile(self.path)
        self.schema, self.num_samples = head.header.schema, stop - first
        ranges = part_ranges(head, first, stop)
        expected = sum(hi - lo for lo, hi in ranges)
        if self.file.size != expected:
            raise CorruptShardError(
                named, "part", f"{expected} bytes (samples [{first}, {stop}))", f"{self.file.size} bytes"
            )
        if bytes(self.file.array[: PREFIX.size]) != head.prefix:
            raise CorruptShardError(
                named, "prefix", "the shard's prefix when its header was read",
                "another: the shard changed since (its size or header)",
            )  # fmt: skip
        self.sections: dict[str, dict[str, list[int]]] = {}
        self._variable: dict[str, tuple[np.ndarray, int]] = {}
        at = PREFIX.size
        for (name, field), (lo, hi) in zip(self.schema.items(), ranges[1:], strict=True):
            self.sections[name] = {"data": [at, hi - lo, 0]}
            if field.kind != "fixed":
                offsets = head.offsets[name][first : stop + 1]
                self._variable[name] = (offsets - offsets[0], at)
            at += hi - lo

    def variable_layout(self, name: str) -> tuple[np.ndarray, int]:
        """(int64 ``[n + 1]`` byte offsets within the part's payload, its start in the file) of a variable
        field, as :meth:`fastio.format.shards.reader.ShardReader.variable_layout` gives a whole shard's.

        Example::

            offsets, base = reader.variable_layout("tokens")
        """
        if name not in self._variable:
            raise TypeError(f"{self.path}: field {name!r} is not variable-length")
        return self._variable[name]

    def ensure_verified(self) -> None:
        """Nothing: a section's crc32 covers the whole section, not a part (see the module docstring)."""
