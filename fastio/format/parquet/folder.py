"""A directory URL (``s3://bucket/train/``, ``hf://datasets/org/name/data/``): the registry's opener of it
(:func:`open_remote_folder`). A fastio shard directory has an ``index.json``; a Hugging Face Hub-style folder
has ``.parquet`` files, found by listing it through fsspec. This module imports neither pyarrow nor a
reader until it knows which: a remote shard directory opens without the ``parquet`` extra.

Example::

    loader = fastio.StreamLoader("hf://datasets/org/name/data/", batch_size=32,
                                 read=fastio.ReadOptions(columns=["text"]))
"""

from __future__ import annotations

from typing import Any

from fastio.format.parquet import PARQUET_SUFFIX, one_split
from fastio.format.shards.remote import open_remote_shards
from fastio.remote.fetch import RemoteNotFoundError, filesystem

__all__ = ["open_remote_folder"]


def open_remote_folder(url: str, options: Any) -> Any:
    """A directory URL as a source: a fastio shard directory (its ``index.json``) as such; without one, the
    ``.parquet`` files under it, listed through fsspec, as one Parquet set (several splits are refused, as
    in a local folder). A store that cannot list (a plain HTTP server), or a folder without ``.parquet``
    files, raises :class:`fastio.remote.RemoteNotFoundError` saying to name the files with a glob.

    Args:
        url: the folder.
        options: a :class:`fastio.options.OpenOptions` (cache, storage options, ``columns``).

    Example::

        source = open_remote_folder("memory://hub/data/", OpenOptions(columns=("label",)))
    """
    try:
        return open_remote_shards(url, options)
    except RemoteNotFoundError as missing:  # no index.json there: a folder of Parquet files?
        try:
            fs, root = filesystem(url, dict(options.storage_options or {}))
            found = sorted(p for p in fs.find(root) if p.endswith(PARQUET_SUFFIX))
        except (OSError, NotImplementedError, ValueError):  # a store that cannot list
            found = []
        if not found:
            raise RemoteNotFoundError(
                url, f"no index.json (not a fastio shard directory: {missing.code}), and no {PARQUET_SUFFIX} "
                f"file listed under it; for Parquet files name them with a glob or braces "
                f"({url.rstrip('/')}/train-*{PARQUET_SUFFIX}) or a list",
            ) from missing  # fmt: skip
    from fastio.format.parquet.remote import open_remote_parquet  # pyarrow: the parquet extra, only now

    urls = [f if "://" in f else fs.unstrip_protocol(f) for f in one_split(root, found)]
    return open_remote_parquet(urls, options)
