"""One remote shard: where it is, what the cache calls it, its sizes (:class:`Shard`), and how its bytes are
brought into a cache entry (:func:`write_shard`: a plain download, or the stream unpacked by a function its
format gave).

Example::

    shard = Shard("http://host/train/shard-000000.fio", cache_key(url, "shard-000000.fio"), 4096, 4096, 13)
    write_shard(shard, part, RetryPolicy(), {}, progress=None)
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from fastio.errors import CorruptShardError, FastIOError
from fastio.remote.fetch import RangeReader, RemoteError, RetryPolicy, download, redact
from fastio.remote.progress import SharedProgress

__all__ = ["Shard", "cache_key", "write_shard"]


@dataclasses.dataclass
class Shard:
    """One shard: where it is, what the cache calls it, and its sizes (``local_size``: bytes of the cached
    file, None until known for a shard stored encoded; ``index_bytes``: what is cached beside it and evicted
    with it, a tar's index).

    ``unpack``: None when the cached file is the remote object's bytes; else ``unpack(raw, out) -> bytes
    written``, which turns the remote stream into the cached file (a compressed tar's decompression, given
    by its format), ``encoding`` naming what it undoes in errors (``"gzip"``)."""

    url: str
    key: str
    remote_size: int
    local_size: int | None
    num_samples: int = 0
    index_bytes: int = 0
    encoding: str | None = None
    unpack: Callable[[IO[bytes], IO[bytes]], int] | None = None

    @property
    def footprint(self) -> int:
        """Bytes the shard takes in the cache."""
        return (self.local_size or self.remote_size) + self.index_bytes


def cache_key(url: str, name: str) -> str:
    """``<digest of the shard's folder URL>/<name>``: one folder per remote folder, without credentials.

    Example::

        cache_key("http://host/train/shard-000.tar", "shard-000.tar")   # "3f0c.../shard-000.tar"
    """
    folder = redact(url).rsplit("/", 1)[0]
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

    if info.unpack is None:
        download(info.url, part, info.remote_size, retry, storage_options, counted, retried)
    else:
        raw = RangeReader(info.url, info.remote_size, retry, storage_options, counted, retried)
        with raw, open(part, "r+b" if part.exists() else "wb") as out:
            try:
                written = info.unpack(raw, out)
            except (RemoteError, FastIOError, ImportError):
                raise
            except Exception as exc:  # the unpacker's own errors (gzip: OSError/EOFError, ZstdError)
                raise CorruptShardError(
                    redact(info.url), "compressed stream", f"a whole {info.encoding} stream", repr(exc)
                ) from None
            out.truncate(written)
    if progress is not None:
        progress.add("downloads", 1)
