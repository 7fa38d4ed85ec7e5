"""What tells one version of a remote object from another: its size and, where the store gives them, its
validators (:func:`remote_object`). The shard cache names an entry after its URL and its validators
(:func:`fastio.remote.shard.cache_key`), so an object republished at the same URL, even with the same size,
is a new entry: downloaded again, never served from the old one's bytes.

The validators are what fsspec's ``info`` reports, as HTTP caches use them: an HTTP server's ``ETag`` and
``Last-Modified`` (from the ``HEAD`` answer), S3's ``ETag`` and ``LastModified``, Google Cloud Storage's
``generation`` and ``etag``, Azure's ``etag`` and ``last_modified``, the Hugging Face Hub's ``blob_id``, a
local file's ``mtime``. A store that
reports none (an HTTP server without either header) leaves the URL and the size as the only identity: an
object rewritten there with the same size is served from the cache until the entry is evicted (or
``cache_dir`` cleared). An old version's entry is left to eviction like any entry no pass reads.

Example::

    obj = remote_object("http://127.0.0.1:8000/train/shard-000.bin", RetryPolicy())
    key = cache_key(obj.url, "shard-000.bin", obj.version)
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fastio.remote.fetch import RetryPolicy, object_info

__all__ = ["VALIDATORS", "RemoteObject", "remote_object", "version_of"]

# fsspec's names of the validators, per store (HTTP, S3, GCS, Azure, the Hub, local files); all there count.
VALIDATORS = (
    "ETag", "etag", "Last-Modified", "LastModified", "last_modified", "generation", "blob_id", "mtime",
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class RemoteObject:
    """An object at ``url``: ``size`` bytes, ``version`` its validators (None: the store gives none)."""

    url: str
    size: int
    version: str | None


def version_of(info: dict[str, Any]) -> str | None:
    """The validators in ``info`` (what fsspec's ``info`` reports), as one string; None when there are none.

    Example::

        assert version_of({"size": 10, "ETag": '"5f-a"'}) == 'ETag="5f-a"'
    """
    found = [f"{name}={info[name]}" for name in VALIDATORS if info.get(name) not in (None, "")]
    return ";".join(found) or None


def remote_object(
    url: str, policy: RetryPolicy, storage_options: dict[str, Any] | None = None
) -> RemoteObject:
    """The object at ``url``: its size and validators, from one ``info`` request under ``policy``.

    Example::

        obj = remote_object("s3://bucket/train/shard-000.bin", RetryPolicy())
        print(obj.size, obj.version)
    """
    info = object_info(url, policy, storage_options)
    return RemoteObject(url, int(info["size"]), version_of(info))
