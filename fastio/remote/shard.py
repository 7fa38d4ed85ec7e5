"""One remote shard, or one part of one: where it is, what the cache calls it, its sizes (:class:`Shard`), and
how its bytes are brought into a cache entry (:func:`write_shard`: a plain download, the stream unpacked by a
function its format gave, or the byte ranges its format listed, back to back).

Example::

    shard = Shard("http://host/train/shard-000000.bin", cache_key(url, "shard-000000.bin"), 4096, 4096, 13)
    write_shard(shard, part, RetryPolicy(), {}, progress=None)
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from fastio.errors import CorruptShardError, FastIOError
from fastio.remote.fetch import (
    RangeReader,
    RemoteError,
    RetryPolicy,
    cat_ranges,
    download,
    redact,
    with_retries,
)
from fastio.remote.progress import SharedProgress

__all__ = ["Shard", "cache_key", "write_shard"]


@dataclasses.dataclass
class Shard:
    """One shard: where it is, what the cache calls it, and its sizes (``local_size``: bytes of the cached
    file, None until known for a shard stored encoded; ``index_bytes``: what is cached beside it and evicted
    with it, such as an index its format builds).

    ``unpack``: None when the cached file is the remote object's bytes; else ``unpack(raw, out) -> bytes
    written``, which turns the remote stream into the cached file (a decompression, given by its format),
    ``encoding`` naming what it undoes in errors.

    ``ranges``: None for a whole object; else the cache entry is these ``[start, stop)`` byte ranges of the
    remote object (of ``remote_size`` bytes) back to back, ``local_size`` bytes in all: a part of a shard
    (some of its samples), whose ranges its format computed (:mod:`fastio.remote.parts`)."""

    url: str
    key: str
    remote_size: int
    local_size: int | None
    num_samples: int = 0
    index_bytes: int = 0
    encoding: str | None = None
    unpack: Callable[[IO[bytes], IO[bytes]], int] | None = None
    ranges: tuple[tuple[int, int], ...] | None = None

    @property
    def footprint(self) -> int:
        """Bytes the shard takes in the cache."""
        return (self.local_size or self.remote_size) + self.index_bytes


def cache_key(url: str, name: str, version: str | None = None) -> str:
    """``<digest of the shard's folder URL>/<name>``: one folder per remote folder, without credentials;
    with the object's ``version`` (its validators, :func:`fastio.remote.identity.version_of`) in the name
    before its last suffix: a version republished at the URL is another entry, of the same suffix.

    Example::

        cache_key("http://host/train/shard-000.bin", "shard-000.bin")   # "3f0c.../shard-000.bin"
        cache_key(url, "shard-000.bin", 'ETag="5f-a"')                  # "3f0c.../shard-000@v1d2e....bin"
    """
    folder = redact(url).rsplit("/", 1)[0]
    if version is not None:
        stem, dot, suffix = name.rpartition(".")
        tag = f"@v{hashlib.sha256(version.encode()).hexdigest()[:16]}"
        name = f"{stem}{tag}{dot}{suffix}" if stem else f"{name}{tag}"
    return f"{hashlib.sha256(folder.encode()).hexdigest()[:16]}/{name}"


def write_shard(
    info: Shard,
    part: Path,
    retry: RetryPolicy,
    storage_options: dict[str, Any],
    progress: SharedProgress | None,
) -> None:
    """Download ``info`` into the cache entry's temporary file ``part`` (unpacking it on the way when it is
    stored encoded), counting bytes, retries and the download in ``progress``.

    Example::

        write_shard(source.shards[3], job.part, source.retry, source.storage_options, source_progress)
    """

    def counted(n: int) -> None:
        if progress is not None:
            progress.add("downloaded_bytes", n)

    def retried(attempt: int, cause: str) -> None:
        if progress is not None:
            progress.add("retries", 1)

    if info.ranges is not None:
        read = functools.partial(cat_ranges, info.url, info.ranges, info.remote_size, retry, storage_options)
        pieces, _ = with_retries(read, info.url, retry, on_retry=retried)
        with open(part, "r+b" if part.exists() else "wb") as out:
            for data in pieces:
                out.write(data)
                counted(len(data))
    elif info.unpack is None:
        download(info.url, part, info.remote_size, retry, storage_options, counted, retried)
    else:
        raw = RangeReader(info.url, info.remote_size, retry, storage_options, counted, retried)
        with raw, open(part, "r+b" if part.exists() else "wb") as out:
            try:
                written = info.unpack(raw, out)
            except (RemoteError, FastIOError, ImportError):
                raise
            except Exception as exc:  # the unpacker's own errors, whatever its format raises
                raise CorruptShardError(
                    redact(info.url), "compressed stream", f"a whole {info.encoding} stream", repr(exc)
                ) from None
            out.truncate(written)
    if progress is not None:
        progress.add("downloads", 1)
