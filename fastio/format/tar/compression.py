"""Compressed tar shards by name and by stream: which suffixes name one (the one list every part of fastio
reads), which codec each suffix means, the name of the tar inside, and streaming decompression.

It imports nothing beyond the standard library, so the registry can match local paths by name without
importing :mod:`fastio.remote` (and fsspec). :mod:`fastio.format.tar.compressed` opens local compressed
shards, :mod:`fastio.format.tar.remote` those at URLs.

Example::

    assert compression_of("s3://b/shard-000.tar.zst") == "zstd"
    assert decompressed_name("a/shard-000.tgz") == "shard-000.tar"
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
