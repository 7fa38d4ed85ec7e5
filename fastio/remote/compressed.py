"""Compressed tar shards (``.tar.gz``/``.tgz``, ``.tar.zst``), local or remote: each is decompressed once,
streaming, into the shard cache (:mod:`fastio.remote.cache`), then indexed and memory-mapped like any tar
(:class:`fastio.remote.source.RemoteTarSource` does the rest: order, resume, exactly-once).

1. The compressed bytes are read through a :class:`fastio.remote.fetch.RangeReader` (ranged reads, each
   retried on transient failures) and decompressed as they arrive, written to the cache entry's temporary
   file in 1 MiB blocks: memory stays one read chunk plus one block whatever the shard's size.
2. A compressed shard's sample count needs its tar, so every compressed shard is decompressed and indexed
   when the source opens (the counts, and the decompressed size, are kept beside the cache entry, so a later
   run or a re-download after eviction does not redo that at open).
3. ``zstandard`` is an optional extra, imported only for ``.tar.zst``.

Example::

    loader = fastio.StreamLoader("data/shard-{000..009}.tar.gz", batch_size=64, shuffle="shard",
                                 cache_dir="/tmp/fastio-cache")
"""

from __future__ import annotations

import gzip
import os
import urllib.parse
from typing import IO, Any

__all__ = [
    "COMPRESSED_SUFFIXES",
    "compression_of",
    "decompress",
    "decompressed_name",
    "is_compressed_tar",
    "open_compressed_tars",
]

COMPRESSED_SUFFIXES = {".tar.gz": "gzip", ".tgz": "gzip", ".tar.zst": "zstd", ".tar.zstd": "zstd"}
_BLOCK = 1 << 20


def _path_part(name: str) -> str:
    return urllib.parse.urlsplit(name).path if "://" in name else name


def compression_of(name: str) -> str | None:
    """``"gzip"``, ``"zstd"`` or None (a plain tar), from a shard's name (a URL's query is ignored).

    Example::

        assert compression_of("s3://b/shard-000.tar.zst") == "zstd"
    """
    path = _path_part(name).lower()
    for suffix, kind in COMPRESSED_SUFFIXES.items():
        if path.endswith(suffix):
            return kind
    return None


def decompressed_name(name: str) -> str:
    """The file name of the tar inside ``name``: ``shard-000.tgz`` -> ``shard-000.tar``.

    Example::

        assert decompressed_name("a/shard-000.tar.gz") == "shard-000.tar"
    """
    base = os.path.basename(_path_part(name))
    for suffix in COMPRESSED_SUFFIXES:
        if base.lower().endswith(suffix):
            return base[: -len(suffix)] + ".tar"
    return base


def _reader(raw: IO[bytes], kind: str) -> IO[bytes]:
    if kind == "gzip":
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if kind == "zstd":
        try:
            import zstandard
        except ImportError as exc:
            raise ImportError(
                ".tar.zst shards need the optional zstandard package: pip install zstandard"
            ) from exc
        return zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)
    raise ValueError(
        f"unknown compression {kind!r} (expected one of {sorted(set(COMPRESSED_SUFFIXES.values()))})"
    )


def decompress(raw: IO[bytes], kind: str, out: IO[bytes]) -> int:
    """Decompress the stream ``raw`` (``kind``: ``"gzip"`` or ``"zstd"``) into ``out`` in 1 MiB blocks;
    returns the bytes written. A corrupt or cut stream raises the decompressor's error (``OSError``,
    ``EOFError``, ``zstandard.ZstdError``).

    Example::

        with open("shard.tar.gz", "rb") as raw, open("shard.tar", "wb") as out:
            decompress(raw, "gzip", out)
    """
    reader = _reader(raw, kind)
    total = 0
    while True:
        block = reader.read(_BLOCK)
        if not block:
            break
        out.write(block)
        total += len(block)
    return total


def is_compressed_tar(target: Any) -> bool:
    """True for a local path, brace or glob pattern (or a list of them) naming compressed tar shards.

    Example::

        assert is_compressed_tar("data/shard-{000..009}.tar.gz")
    """
    if isinstance(target, str):
        return compression_of(target) is not None
    return (
        isinstance(target, list)
        and bool(target)
        and all(isinstance(t, str) and compression_of(t) is not None for t in target)
    )


def open_compressed_tars(target: str | list[str], options: Any) -> Any:
    """The registry's opener of local compressed tar shards: a
    :class:`fastio.remote.source.RemoteTarSource` over them (reading local files through fsspec), so they
    are decompressed into ``options.cache_dir`` and share the remote source's cache, order and resume.

    Example::

        source = open_compressed_tars("data/shard-{000..003}.tgz", OpenOptions(cache_dir="/tmp/c"))
    """
    from fastio.format.tar import expand_pattern
    from fastio.remote.source import open_remote

    paths = expand_pattern(target)
    for path in paths:
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path}: no such tar shard")
    return open_remote([os.path.abspath(p) for p in paths], options)
